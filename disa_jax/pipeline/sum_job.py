"""The main job: the whole DISA pipeline on the sum task, checked against the exact partition function.

Stages (each writes to the workdir and is skipped when its output exists, so a rerun resumes):

0. models/     pi_ref (weak, broad) and p_T (stronger, other preference), trained here, saved as HF
               checkpoints, reloaded through `from_pretrained` from then on.
1. stage1/     N proposal samples per prompt from p_T in the generation process, scored under pi_ref,
               graded; log Z_IS labels and diagnostics (eq. 6); the N-study against the exact log Z.
   exact.json  exact log Z(q) from the n + 1 correct answers scored under pi_ref.
2. anchor/     g_psi on mean-pooled pi_ref prompt states, fitted to the labels and frozen.
   anchor_study.json  sigma_g against the exact log Z of plain least squares vs sharper label / weighting
               variants (Jensen, jackknife, inverse-variance WLS) at each N, cross-validated (issue 9).
3. stage3/<m>/ DISA, FlowRL, GRPO, GSPO from pi_ref in the same loop; final policies exported as HF.
               'disa+replay' / 'flowrl+replay' mix Stage 1 samples into each batch (`disa_jax.rl.replay`);
               with several Stage 3 seeds, runs after the first are in stage3/<m>_seed<s>/.
   sft/        the LoRA-SFT baseline (App. C.4): pi_ref + LoRA on the reward-1 Stage 1 samples, merged.
4. eval/<m>.json and report.{json,md} + PNG plots: accuracy, pass@k, distinct correct answers,
               entropy over correct answers, KL(pi_theta || pi~) against the exact target.
"""
from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any, Sequence

import jax
import numpy as np

from disa_jax import estimators as E
from disa_jax.data.sum_task import SumTask, make_tokenizer

REFERENCE_ROWS = ("reference", "proposal")
METHODS = ("disa", "flowrl", "grpo", "gspo", "disa+replay", "flowrl+replay")


def base_method(name: str) -> str:
  """'disa+replay' -> 'disa' (the loss of a main-job method name)."""
  return name.split("+")[0]


@dataclasses.dataclass(frozen=True)
class MainConfig:
  """Typed, validated view of `configs/main.py` (see the comments there)."""

  seed: int
  engine: str
  beta: float
  methods: tuple[str, ...]
  seeds: tuple[int, ...]
  replay_fraction: float
  task: SumTask
  max_tokens: int
  arch: Any
  ref_warmup: Any
  proposal_warmup: Any
  samples: int
  pool: int
  stage1_temperature: float
  n_study: tuple[int, ...]
  n_study_repeats: int
  fit: Any
  study_repeats: int
  study_folds: int
  stage3: dict
  sft: dict
  eval_samples: int
  kl_samples: int

  @classmethod
  def from_config(cls, c) -> "MainConfig":
    from disa_jax.anchor import AnchorFitConfig
    from disa_jax.pipeline.sum_models import TinyLMSpec, WarmupSpec

    def need(cond: bool, field: str, value: Any, what: str) -> None:
      if not cond:
        raise ValueError(f"config.{field}={value!r}: {what}")

    need(c.engine in ("jax", "vllm"), "engine", c.engine, "must be 'jax' or 'vllm'")
    need(c.beta > 0, "beta", c.beta, "must be > 0")
    bad = [m for m in c.methods if m not in METHODS]
    need(not bad and len(c.methods) > 0, "methods", c.methods, f"must be a non-empty subset of {METHODS}")
    seeds = tuple(c.stage3.seeds)
    need(len(seeds) >= 1 and len(set(seeds)) == len(seeds) and all(isinstance(x, int) for x in seeds),
         "stage3.seeds", c.stage3.seeds, "must be distinct ints, at least one")
    need(0 < c.stage3.replay_fraction < 1, "stage3.replay_fraction", c.stage3.replay_fraction, "must be in (0, 1)")
    need(c.task.max_tokens >= 6, "task.max_tokens", c.task.max_tokens, "must be >= 6 (the longest correct answer)")
    need(c.stage1.samples >= 1, "stage1.samples", c.stage1.samples, "must be >= 1")
    need(c.stage1.pool >= max(c.stage1.samples, *c.stage1.n_study), "stage1.pool", c.stage1.pool,
         "must be >= stage1.samples and every stage1.n_study value")
    need(c.stage1.temperature > 0, "stage1.temperature", c.stage1.temperature, "must be > 0")
    need(c.stage2.study_repeats >= 0, "stage2.study_repeats", c.stage2.study_repeats, "must be >= 0 (0 = off)")
    need(c.stage2.study_folds >= 2, "stage2.study_folds", c.stage2.study_folds, "must be >= 2")
    for f in ("steps", "prompts_per_batch", "group_size", "num_minibatches", "micro_batch_size"):
      need(c.stage3[f] >= 1, f"stage3.{f}", c.stage3[f], "must be >= 1")
    k = round(c.stage3.replay_fraction * c.stage3.group_size)
    need(not any("+replay" in m for m in c.methods) or 1 <= k < c.stage3.group_size, "stage3.replay_fraction",
         c.stage3.replay_fraction, f"must replay between 1 and group_size - 1 of the {c.stage3.group_size} samples")
    need(c.stage3.lr > 0, "stage3.lr", c.stage3.lr, "must be > 0")
    need(c.sft.rank >= 1 and c.sft.batch_size >= 1 and c.sft.epochs >= 1, "sft", dict(c.sft),
         "rank, batch_size and epochs must be >= 1")
    need(c.sft.learning_rate > 0, "sft.learning_rate", c.sft.learning_rate, "must be > 0")
    need(c.eval.samples >= 1 and c.eval.kl_samples >= 2, "eval", dict(c.eval), "samples >= 1 and kl_samples >= 2")
    try:
      task = SumTask(c.task.n_min, c.task.n_max)
      m = c.models
      arch = TinyLMSpec(m.hidden_size, m.intermediate_size, m.num_layers, m.num_heads, m.num_kv_heads, m.head_dim)
      ref = WarmupSpec(m.ref_correct_frac, m.ref_skew, m.ref_steps, m.batch_size, m.learning_rate, c.seed)
      prop = WarmupSpec(m.proposal_correct_frac, m.proposal_skew, m.proposal_steps, m.batch_size,
                        m.learning_rate, c.seed + 1)
      fit = AnchorFitConfig(hidden_sizes=tuple(c.stage2.hidden_sizes), learning_rate=c.stage2.learning_rate,
                            batch_size=c.stage2.batch_size, epochs=c.stage2.epochs,
                            val_fraction=c.stage2.val_fraction, seed=c.seed)
    except ValueError as e:
      raise ValueError(f"config: {e}") from None
    return cls(seed=c.seed, engine=c.engine, beta=float(c.beta), methods=tuple(c.methods), seeds=seeds,
               replay_fraction=float(c.stage3.replay_fraction), task=task,
               max_tokens=c.task.max_tokens, arch=arch, ref_warmup=ref, proposal_warmup=prop,
               samples=c.stage1.samples, pool=c.stage1.pool, stage1_temperature=c.stage1.temperature,
               n_study=tuple(c.stage1.n_study), n_study_repeats=c.stage1.n_study_repeats, fit=fit,
               study_repeats=c.stage2.study_repeats, study_folds=c.stage2.study_folds,
               stage3=dict(c.stage3), sft=dict(c.sft), eval_samples=c.eval.samples, kl_samples=c.eval.kl_samples)


def _write_json(path: Path, obj: Any) -> None:
  tmp = path.with_suffix(path.suffix + ".tmp")
  tmp.write_text(json.dumps(obj, indent=1, default=float))
  tmp.replace(path)


class SumJob:
  """Runs the stages of the module docstring in ``workdir``."""

  def __init__(self, cfg: MainConfig, workdir: str | Path, *, progress: bool = True):
    self.cfg = cfg
    self.dir = Path(workdir).resolve()
    self.dir.mkdir(parents=True, exist_ok=True)
    self.progress = progress
    self.tok = make_tokenizer()
    self.task = cfg.task
    self.prompt_ids = {n: self.tok.encode(self.task.prompt(n), add_special_tokens=False) for n in self.task.ns}
    self.times: dict[str, float] = {}
    timing = self.dir / "times.json"
    if timing.exists():
      self.times.update(json.loads(timing.read_text()))

  def _timed(self, name: str, fn, *args, **kw):
    t0 = time.time()
    out = fn(*args, **kw)
    if name not in self.times:  # the time of the run that did the work (a resumed run skips the stage)
      self.times[name] = round(time.time() - t0, 2)
      _write_json(self.dir / "times.json", self.times)
    return out

  @property
  def ref_path(self) -> str:
    return str(self.dir / "models" / "reference")

  @property
  def proposal_path(self) -> str:
    return str(self.dir / "models" / "proposal")

  # ---------------------------------------------------------------------------------------------
  # 0. models
  # ---------------------------------------------------------------------------------------------

  def build_models(self) -> dict | None:
    from disa_jax.pipeline.sum_models import save_model, train_sum_model
    out = {}
    ref_marker = Path(self.ref_path) / "warmup.json"
    prop_marker = Path(self.proposal_path) / "warmup.json"
    if not ref_marker.exists():
      model, summary = train_sum_model(self.task, self.cfg.arch, self.cfg.ref_warmup, progress=self.progress,
                                       desc="warm-up reference")
      save_model(model, self.ref_path)
      _write_json(ref_marker, {k: v for k, v in summary.items() if k != "losses"}
                  | {"spec": dataclasses.asdict(self.cfg.ref_warmup)})
      out["reference"] = summary
    if not prop_marker.exists():  # p_T = pi_ref fine-tuned on more, and differently preferred, correct answers
      model, summary = train_sum_model(self.task, self.cfg.arch, self.cfg.proposal_warmup,
                                       init_from=self.load(self.ref_path), progress=self.progress,
                                       desc="warm-up proposal")
      save_model(model, self.proposal_path)
      _write_json(prop_marker, {k: v for k, v in summary.items() if k != "losses"}
                  | {"spec": dataclasses.asdict(self.cfg.proposal_warmup), "init_from": self.ref_path})
      out["proposal"] = summary
    return out or None

  def load(self, path: str):
    from disa_jax.models import from_pretrained
    return from_pretrained(path)

  def scorer(self, model):
    from disa_jax.scoring.batched import SequenceScorer
    return SequenceScorer(model, pad_id=self.tok.pad_token_id, batch_size=64, pad_to=16)

  # ---------------------------------------------------------------------------------------------
  # exact log Z
  # ---------------------------------------------------------------------------------------------

  def exact(self) -> dict:
    path = self.dir / "exact.json"
    if path.exists():
      return json.loads(path.read_text())
    from disa_jax.pipeline.exact import log_z_from_reference, score_correct_set
    ref_scores = score_correct_set(self.task, self.tok, self.scorer(self.load(self.ref_path)), self.prompt_ids,
                                   self.task.ns)
    out = {"ns": self.task.ns, "beta": self.cfg.beta,
           "log_z": log_z_from_reference(ref_scores, self.cfg.beta).tolist(),
           "p_correct_ref": ref_scores.p_correct().tolist(),
           "target_entropy_correct": ref_scores.entropy().tolist(),
           "ref_logp_correct": [lp.tolist() for lp in ref_scores.logp]}
    _write_json(path, out)
    return out

  # ---------------------------------------------------------------------------------------------
  # 1. Stage 1
  # ---------------------------------------------------------------------------------------------

  def _reward_fn(self, prompts, comps, texts):
    return np.asarray([self.task.reward(self.tok, p.meta, c.token_ids.tolist()) for p, c in zip(prompts, comps)])

  def stage1(self) -> dict | None:
    from disa_jax.estimators.collect import Stage1Prompt, collect_stage1
    from disa_jax.rollout import SamplingParams, make_engine
    pool_path = self.dir / "stage1" / "pool.jsonl"
    pool_path.parent.mkdir(exist_ok=True)
    writer = E.Stage1Writer(pool_path)
    prompts = [Stage1Prompt(self.task.prompt_id(n), self.task.prompt(n), tuple(self.prompt_ids[n]), n)
               for n in self.task.ns]
    stats = None
    if len(writer.completed_ids()) < len(prompts):
      sampling = SamplingParams(n=self.cfg.pool, temperature=self.cfg.stage1_temperature, max_tokens=self.cfg.max_tokens,
                                stop_token_ids=(self.tok.eos_token_id,), seed=self.cfg.seed)
      with make_engine(self.cfg.engine, self.proposal_path, **self._engine_kwargs()) as engine:
        stats = collect_stage1(engine=engine, ref_scorer=self.scorer(self.load(self.ref_path)), prompts=prompts,
                               reward_fn=self._reward_fn, decode=self.tok.decode, sampling=sampling,
                               beta=self.cfg.beta, reward_transform=E.RewardTransform("raw"), writer=writer,
                               label_scale="sum", prompts_per_batch=len(prompts), progress=self.progress)
    labels_path = self.dir / "stage1" / "labels.jsonl"
    if not labels_path.exists():  # the N-sample labels: the first N of each prompt's i.i.d. pool
      pool = E.load_stage1(pool_path)
      recs = E.build_records(pool.prompt_ids, pool.prompts, [r["samples"][:self.cfg.samples] for r in pool.records],
                             beta=self.cfg.beta, reward_transform=E.RewardTransform("raw"), label_scale="sum")
      tmp = labels_path.with_name("labels.partial.jsonl")
      tmp.unlink(missing_ok=True)
      E.Stage1Writer(tmp, fmt="jsonl").write(recs)
      tmp.replace(labels_path)
    return stats

  def _engine_kwargs(self) -> dict:
    if self.cfg.engine == "vllm":
      return {"env": {"VLLM_CPU_KVCACHE_SPACE": "1"}}
    return {}

  # ---------------------------------------------------------------------------------------------
  # 2. Stage 2
  # ---------------------------------------------------------------------------------------------

  def stage2(self):
    from disa_jax.anchor import Anchor, fit_anchor
    from disa_jax.anchor.embeddings import embed_prompts
    anchor_dir = self.dir / "anchor"
    if (anchor_dir / "anchor_meta.json").exists():
      return None
    data = E.load_stage1(self.dir / "stage1" / "labels.jsonl")
    ns = [int(pid[3:]) for pid in data.prompt_ids]
    emb, spec = embed_prompts(self.load(self.ref_path), [self.prompt_ids[n] for n in ns],
                              pad_id=self.tok.pad_token_id, model_path=self.ref_path)
    res = fit_anchor(emb, data.labels, embedding=spec, beta=self.cfg.beta, reward_transform=data.reward_transform,
                     label_scale=data.label_scale, config=self.cfg.fit)
    anchor = res.anchor
    anchor.meta = dataclasses.replace(anchor.meta, fit_summary=dict(res.summary(), val_ns=[ns[i] for i in res.val_idx],
                                                                    history=res.history))
    anchor.save(anchor_dir)
    return res.summary()

  def anchor_study(self) -> dict | None:
    """sigma_g of each Stage 2 label / weighting variant against the exact log Z (`pipeline.anchor_study`)."""
    from disa_jax.anchor.embeddings import embed_prompts
    from disa_jax.pipeline.anchor_study import sigma_g_study, sigma_verdict
    path = self.dir / "anchor_study.json"
    if path.exists() or not self.cfg.study_repeats:
      return None
    pool = E.load_stage1(self.dir / "stage1" / "pool.jsonl")
    ns = [int(pid[3:]) for pid in pool.prompt_ids]
    exact = self.exact()
    by_n = dict(zip(exact["ns"], exact["log_z"]))
    emb, _ = embed_prompts(self.load(self.ref_path), [self.prompt_ids[n] for n in ns], pad_id=self.tok.pad_token_id)
    res = sigma_g_study(emb, pool, np.asarray([by_n[n] for n in ns]), ns=self.cfg.n_study, folds=self.cfg.study_folds,
                        repeats=self.cfg.study_repeats, fit=self.cfg.fit, seed=self.cfg.seed)
    res["verdict"] = sigma_verdict(res)
    _write_json(path, res)
    return None

  # ---------------------------------------------------------------------------------------------
  # 3. Stage 3
  # ---------------------------------------------------------------------------------------------

  def run_name(self, method: str, seed: int) -> str:
    """The Stage 3 run directory / evaluation row of (method, seed)."""
    return method if seed == self.cfg.seeds[0] else f"{method}_seed{seed}"

  def train_config(self, name: str, seed: int):
    from disa_jax.rl import config as C
    s = self.cfg.stage3
    method = base_method(name)
    gspo = method == "gspo"
    replay = C.ReplayCfg()
    if name.endswith("+replay"):  # the Stage 1 samples behind the labels (N per prompt)
      replay = C.ReplayCfg(path=str(self.dir / "stage1" / "labels.jsonl"), fraction=self.cfg.replay_fraction)
    loss = C.LossCfg(method=method, beta=self.cfg.beta, length_normalize=False,
                     reward_transform=E.RewardTransform("raw"), omega_mode="one",
                     eps_low=3e-4 if gspo else 0.2, eps_high=4e-4 if gspo else 0.28,
                     logz_head_lr=s["flowrl_head_lr"])
    return C.TrainConfig(
        model=C.ModelCfg(policy_path=self.ref_path, dtype="float32", remat=False), loss=loss,
        optim=C.OptimCfg(lr=s["lr"], weight_decay=0.0),
        rollout=C.RolloutCfg(prompts_per_batch=s["prompts_per_batch"], group_size=s["group_size"],
                             max_prompt_len=64, max_response_len=self.cfg.max_tokens, engine=self.cfg.engine,
                             num_minibatches=s["num_minibatches"], micro_batch_size=s["micro_batch_size"]),
        data=C.DataCfg(reward="sum_task", anchor_path=str(self.dir / "anchor") if method == "disa" else ""),
        replay=replay,
        mesh=C.MeshCfg(1, 1, 1), checkpoint=C.CheckpointCfg(every=max(1, s["steps"] // 4), keep=1),
        seed=seed, total_steps=s["steps"], progress_bar=self.progress)

  def stage3(self, method: str, seed: int | None = None):
    from disa_jax.anchor import Anchor
    from disa_jax.models import save_pretrained
    from disa_jax.rl.trainer import PromptItem, Trainer
    from disa_jax.parallel import make_mesh
    from disa_jax.rollout import make_engine
    seed = self.cfg.seeds[0] if seed is None else seed
    wd = self.dir / "stage3" / self.run_name(method, seed)
    final = wd / "final"
    if (final / "config.json").exists():
      return None
    wd.mkdir(parents=True, exist_ok=True)
    cfg = self.train_config(method, seed)
    items = [PromptItem(self.task.prompt_id(n), tuple(self.prompt_ids[n]), {"n": n}) for n in self.task.ns]
    reward_fn = lambda its, resp: np.asarray([self.task.reward(self.tok, it.meta["n"], r) for it, r in zip(its, resp)],
                                             np.float32)
    policy = self.load(self.ref_path)
    with make_engine(self.cfg.engine, self.ref_path, **self._engine_kwargs()) as engine:
      trainer = Trainer(cfg, str(wd), policy=policy, reference=self.load(self.ref_path), engine=engine,
                        prompts=items, reward_fn=reward_fn, stop_token_ids=(self.tok.eos_token_id,),
                        pad_id=self.tok.pad_token_id,
                        anchor=Anchor.load(self.dir / "anchor") if cfg.loss.method == "disa" else None,
                        mesh=make_mesh(1, 1, 1, devices=jax.devices()[:1]), pad_to=16)
      try:
        trainer.run()
      finally:
        trainer.close()
    from flax import nnx
    nnx.update(policy, trainer.state.params)
    save_pretrained(policy, str(final))
    self.tok.save_pretrained(str(final))
    return True

  def lora_sft(self):
    """The LoRA-SFT baseline (App. C.4): pi_ref + LoRA on the reward-1 Stage 1 samples, merged and exported."""
    from disa_jax.sft.baseline import LoRASFTConfig, run_lora_sft
    labels = E.load_stage1(self.dir / "stage1" / "labels.jsonl")
    if not (labels.reward[labels.mask] >= 1.0).any():  # nothing to distil: say so in the report
      _write_json(self.dir / "sft_skipped.json", {"reason": "no Stage 1 sample has reward 1"})
      return None
    s = self.cfg.sft
    cfg = LoRASFTConfig(rank=s["rank"], alpha=2.0 * s["rank"], learning_rate=s["learning_rate"],
                        batch_size=s["batch_size"], micro_batch_size=s["batch_size"], epochs=s["epochs"],
                        max_seq_len=64, pad_to=16, seed=self.cfg.seed, checkpoint_every=0)
    summary = run_lora_sft(self.ref_path, str(self.dir / "stage1" / "labels.jsonl"), str(self.dir / "sft"), cfg,
                           encode_prompt=lambda t: self.tok.encode(t, add_special_tokens=False))
    return None if summary.get("skipped") else summary

  # ---------------------------------------------------------------------------------------------
  # 4. evaluation against the exact target
  # ---------------------------------------------------------------------------------------------

  def _eval_tools(self):
    """One in-process sampler and two scorers shared by every evaluation (weights swapped, no recompile)."""
    if not hasattr(self, "_eval_cache"):
      from disa_jax.rollout import make_engine
      self._eval_cache = (make_engine("jax", self.ref_path, separate_process=False),
                          self.scorer(self.load(self.ref_path)), self.scorer(self.load(self.ref_path)))
    return self._eval_cache

  def evaluate(self, name: str, path: str, exact: dict) -> dict:
    from disa_jax.models import to_hf_state_dict
    from disa_jax.pipeline.exact import kl_to_target_mc, score_correct_set
    from disa_jax.rollout import SamplingParams
    out_path = self.dir / "eval" / f"{name}.json"
    if out_path.exists():
      return json.loads(out_path.read_text())
    out_path.parent.mkdir(exist_ok=True)
    engine, ref_scorer, pol_scorer = self._eval_tools()
    model = self.load(path)
    engine.update_weights(to_hf_state_dict(model))
    pol_scorer.update(model)
    ns = self.task.ns
    pol = score_correct_set(self.task, self.tok, pol_scorer, self.prompt_ids, ns)
    stop = (self.tok.eos_token_id,)
    prompts = [self.prompt_ids[n] for n in ns]
    k = self.cfg.eval_samples
    comps = engine.generate(prompts, SamplingParams(n=k, temperature=1.0, max_tokens=self.cfg.max_tokens,
                                                    stop_token_ids=stop, seed=self.cfg.seed + 7))
    kl_comps = engine.generate(prompts, SamplingParams(n=self.cfg.kl_samples, temperature=1.0,
                                                       max_tokens=self.cfg.max_tokens, stop_token_ids=stop,
                                                       seed=self.cfg.seed + 8, return_raw_logprobs=True))
    rewards = np.asarray([[self.task.reward(self.tok, n, c.token_ids.tolist()) for c in cs] for n, cs in zip(ns, comps)])
    distinct = [len({self.task.parse(self.tok, c.token_ids.tolist()) for c, r in zip(cs, rr) if r > 0})
                for cs, rr in zip(comps, rewards)]
    kl_r = np.asarray([[self.task.reward(self.tok, n, c.token_ids.tolist()) for c in cs] for n, cs in zip(ns, kl_comps)])
    flat_lp = ref_scorer.sequence_logprobs([prompts[i] for i, cs in enumerate(kl_comps) for _ in cs],
                                           [c.token_ids.tolist() for cs in kl_comps for c in cs])
    kl, kl_se = kl_to_target_mc(kl_comps, kl_r, flat_lp.reshape(kl_r.shape), np.asarray(exact["log_z"]),
                                self.cfg.beta)
    res = {
        "accuracy_mean_at_k": float(rewards.mean()), "pass_at_k": float((rewards.max(1) > 0).mean()),
        "k": int(rewards.shape[1]),
        "distinct_correct_mean": float(np.mean(distinct)),
        "p_correct_exact": float(pol.p_correct().mean()),
        "entropy_correct": float(pol.entropy().mean()),
        "target_entropy_correct": float(np.mean(exact["target_entropy_correct"])),
        "kl_to_target": float(kl.mean()), "kl_to_target_se": float(np.sqrt(np.sum(kl_se ** 2)) / len(kl)),
    }
    _write_json(out_path, res)
    return res

  # ---------------------------------------------------------------------------------------------
  # everything
  # ---------------------------------------------------------------------------------------------

  def run(self) -> dict:
    from disa_jax.pipeline.report import write_report
    self._timed("models", self.build_models)
    self._timed("stage1", self.stage1)
    exact = self._timed("exact_log_z", self.exact)
    self._timed("stage2", self.stage2)
    self._timed("anchor_study", self.anchor_study)
    rows = {"reference": self.ref_path, "proposal": self.proposal_path}
    for m in self.cfg.methods:
      for seed in self.cfg.seeds:
        name = self.run_name(m, seed)
        self._timed(f"stage3_{name}", self.stage3, m, seed)
        rows[name] = str(self.dir / "stage3" / name / "final")
    skipped = {}
    if self.cfg.sft["enabled"]:
      self._timed("lora_sft", self.lora_sft)
      if (self.dir / "sft" / "config.json").exists():
        rows["lora_sft"] = str(self.dir / "sft")
      else:
        skipped["lora_sft"] = json.loads((self.dir / "sft_skipped.json").read_text())["reason"]
    evals = {name: self._timed(f"eval_{name}", self.evaluate, name, path, exact) for name, path in rows.items()}
    return write_report(self, exact, evals, skipped)
