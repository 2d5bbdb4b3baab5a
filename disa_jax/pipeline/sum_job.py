"""The main job: the whole DISA pipeline on the sum task, checked against the exact partition function.

A thin driver over the real workflows. It builds what only the sum task has (its tiny models and its
prompt file), then runs the commands a researcher runs on real checkpoints, with the configs of
`configs/main.py`; each stage is skipped when its output exists, so a rerun resumes:

0. models/          pi_ref (weak, broad) and p_T (stronger, other preference) as HF checkpoints: the
                    pinned ones (`pipeline.pinned`), or trained here (``rebuild_models``, or no pin);
                    data/sum_prompts.jsonl, the prompts as veRL rows.
1. stage1/          `run_stage1`: N-study pool of proposal samples per prompt, graded by the
                    registered 'sum_task' reward, scored under pi_ref, labelled (eq. 8).
   exact.json       the exact log Z(q) (`disa_jax.eval.exact`), for the report and the oracle anchor.
2. stage2/, anchor/ `run_stage2`: g_psi on pi_ref's prompt embeddings, fitted to the labels of the
                    first N samples, frozen; anchor_exact/: the exact log Z as a `TableAnchor`.
   anchor_study.json  sigma_g of sharper label / weighting variants (`pipeline.anchor_study`).
3. stage3/<run>/    `run_stage3` per run and seed (DISA, FlowRL, GRPO, GSPO, ...; the policy exported
                    to final/); sft/: `run_sft`, the LoRA-SFT baseline.
4. eval/<row>/      `run_evaluation` of every model on the prompts, with the exact target;
   conditional_kl.json  with ``conditional_kl``, each model's preference among correct answers
                    (`pipeline.conditional_kls`, cached per checkpoint).
   report.{json,md} and PNG plots (`pipeline.report`, from the job's `JobPlan` and the stages'
                    outputs in memory); `run` returns it as a `JobReport`.

Stage 3's units and the evaluation rows run in `pipeline.job_workers` (here or on spawned workers).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import time
import warnings
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from disa_jax import artifacts, codec
from disa_jax import config as config_lib
from disa_jax import models, paths, runtime
from disa_jax.anchor import TableAnchor, noisy_log_z
from disa_jax.anchor.table import TABLE_FILE
from disa_jax.checkpoint.lock import OutputLock
from disa_jax.data.prompting import encode_prompt
from disa_jax.data.records import PromptRecord
from disa_jax.data.rows import save_prompts
from disa_jax.estimators.dataset import Stage1Data
from disa_jax.estimators.reward_transforms import RewardTransform
from disa_jax.eval.conditional import conditional_kl
from disa_jax.eval.exact import ExactTarget, ExactTargetConfig
from disa_jax.models import from_pretrained
from disa_jax.parallel.mesh import MeshConfig
from disa_jax.pipeline.anchor_study import SigmaStudy, sigma_g_study, sigma_verdict
from disa_jax.pipeline import job_workers, pinned, seeds
from disa_jax.pipeline.conditional_kls import ConditionalKL, ConditionalKLs, model_identity
from disa_jax.pipeline.heldout import split_values
from disa_jax.pipeline.job_config import MainConfig, RunSpec
from disa_jax.pipeline.job_report import JobReport
from disa_jax.pipeline.plan import job_plan
from disa_jax.pipeline.provenance import provenance
from disa_jax.pipeline.report import ReportInputs, write_report
from disa_jax.pipeline.stage12 import AnchorReport, write_anchor_report
from disa_jax.pipeline.sum_models import MARKER, WarmupSpec, save_warmed_model, train_sum_model
from disa_jax.scoring.batched import SequenceScorer
from disa_jax.tasks.prompts import load_prompts
from disa_jax.tasks.sum import SumTask, correct_set, task_tokenizer
from disa_jax.workflows.evaluation import EvalConfig, EvalResult
from disa_jax.workflows.nstudy import NStudyConfig, NStudyResult, run_nstudy
from disa_jax.workflows.sft import SftConfig, SftRun, run_sft
from disa_jax.workflows.stage1 import Stage1Config, Stage1Result, run_stage1
from disa_jax.workflows.stage2 import AnchorArtifact, Stage2Config, run_stage2
from disa_jax.workflows.stage3 import BackboneConfig, DataConfig, Stage3Config, Stage3Run

SFT_SKIPPED = "no Stage 1 sample has reward 1"  # why a job has no LoRA-SFT row


def _save_prompts(records: list[PromptRecord], path: str) -> None:
  """`save_prompts` through a temporary file renamed into place: whole or not at all."""
  p = Path(path)
  tmp = p.with_name(f"{p.stem}.tmp{p.suffix}")
  save_prompts(records, str(tmp))
  paths.replace(tmp, p)


def _derived(where: str, cfg: Any, **changes: Any) -> Any:
  """``dataclasses.replace(cfg, **changes)`` (validated again), its errors naming ``where``."""
  try:
    return dataclasses.replace(cfg, **changes)
  except (TypeError, ValueError) as e:
    raise ValueError(config_lib.qualify(str(e), where)) from None


def prompt_records(task: SumTask) -> list[PromptRecord]:
  """The task's prompts as `PromptRecord`s: ability and data source 'sum_task', ground truth n
  (a string, as veRL stores math answers); `disa_jax.data.rows.save_prompts` writes them."""
  return [PromptRecord(task.prompt_id(n), [{"role": "user", "content": task.prompt(n)}], str(n),
                       "sum_task", {"ability": "sum_task", "n": n}) for n in task.ns]


def job_times(times: Mapping[str, float], rows: Mapping[str, str],
              data_seeds: Mapping[int, Any]) -> dict[str, float]:
  """The seconds of this job's own stages, from a workdir's times.json.

  times.json keeps the time of every stage the workdir ever ran (a resumed stage keeps the time of
  the run that did the work), so a workdir reused by another preset also holds its runs' times. The
  report keeps the job's: ``stage3_<row>`` and ``eval_<row>`` for the rows it evaluates, and
  ``stage1_data<d>`` / ``stage2_data<d>`` for its Stage 1/2 replicates ``data_seeds``.
  """
  def mine(name: str) -> bool:
    for prefix in ("stage3_", "eval_"):
      if name.startswith(prefix):
        return name[len(prefix):] in rows
    for prefix in ("stage1_data", "stage2_data"):
      if name.startswith(prefix) and name[len(prefix):].isdigit():
        return int(name[len(prefix):]) in data_seeds
    return True
  return {k: v for k, v in times.items() if mine(k)}


class SumJob:
  """Runs the stages of the module docstring in ``workdir`` (every stage config built and
  validated here, before any work)."""

  def __init__(self, cfg: MainConfig, workdir: str | Path, *, progress: bool = True):
    self.cfg, self.progress = cfg, progress
    self.dir = Path(workdir).resolve()
    self.plan = job_plan(cfg, self.dir)  # the runs as data: names, roles, regimes (the report's)
    self.task = SumTask(cfg.task.n_min, cfg.task.n_max)
    self.tok = task_tokenizer()
    self.arch = cfg.arch
    # Stage 1/2 per data seed a run reads (`RunSpec.data_seed`; 0 = the job's own, always run)
    self.replicas = {d: self._stage12_configs(d) for d in sorted(
        {0} | {cfg.runs[m].data_seed for m in cfg.methods})}
    self.stage1_cfg, self.stage2_cfg = self.replicas[0]
    self.stage3_cfgs = {(m, s): self._stage3_config(m, s) for m in cfg.methods
                        for s in cfg.run_seeds(m)}
    self.run_of_row = {row: (m, s) for m, r in self.plan.runs.items()
                       for s, row in zip(r.seeds, r.rows)}
    self.sft_cfg = self._sft_config()
    self.eval_template = self._eval_config("reference", self.ref_path)
    self.times: dict[str, float] = {}
    self.dir.mkdir(parents=True, exist_ok=True)
    if (self.dir / "times.json").exists():
      self.times.update(json.loads((self.dir / "times.json").read_text()))

  # -- paths and configs -------------------------------------------------------------------------

  ref_path = property(lambda self: str(self.dir / "models" / "reference"))
  train_prompts_path = property(lambda self: str(self.dir / "data" / "sum_prompts_train.jsonl")
                                if self.cfg.heldout.enabled else self.prompts_path)
  heldout_prompts_path = property(lambda self: str(self.plan.heldout_prompts_path))
  proposal_path = property(lambda self: str(self.dir / "models" / "proposal"))
  prompts_path = property(lambda self: str(self.dir / "data" / "sum_prompts.jsonl"))
  exact_anchor_path = property(lambda self: str(self.dir / "anchor_exact"))
  mesh = property(lambda self: MeshConfig(fsdp=1, num_devices=1))

  def noise_anchor_path(self, sigma: float, d: int = 0) -> str:
    """The 'exact+noise' anchor of RMS ``sigma`` drawn for data seed ``d`` (an anchor replica)."""
    return str(self.dir / (f"anchor_exact_noise{sigma:g}" + (f"_data{d}" if d else "")))

  def _anchor_path(self, spec: RunSpec) -> str:
    if not spec.objective.needs_anchor:
      return ""
    return {"fitted": self.replicas[spec.data_seed][1].anchor_path,
            "exact": self.exact_anchor_path}.get(spec.anchor) or self.noise_anchor_path(
                spec.sigma, spec.data_seed)

  def _stage12_configs(self, d: int) -> tuple[Stage1Config, Stage2Config]:
    """Stage 1 and Stage 2 of data seed ``d`` (`RunSpec.data_seed`): the job's sampling and fit
    seeds + d, in ``stage1/``, ``stage2/``, ``anchor/`` (d = 0) or ``<name>_data<d>/``."""
    s1, s2 = self.cfg.stage1, self.cfg.stage2
    where = lambda name: str(self.dir / (name if d == 0 else f"{name}_data{d}"))
    stage1 = _derived("stage1", s1, prompts_path=self.prompts_path, reference_path=self.ref_path,
                      proposal_path=self.proposal_path, output_dir=where("stage1"),
                      beta=self.cfg.beta, engine=self.cfg.engine, progress=self.progress,
                      sampling=dataclasses.replace(s1.sampling, seed=s1.sampling.seed + d))
    held_out = self.cfg.heldout.enabled and self.cfg.heldout.anchor
    stage2 = _derived("stage2", s2, stage1_path=str(stage1.dataset_path()),
                      exclude_prompts_path=self.heldout_prompts_path if held_out else "",
                      reference_path=self.ref_path, anchor_path=where("anchor"),
                      output_dir=where("stage2"),
                      fit=dataclasses.replace(s2.fit, seed=seeds.job_seed(self.cfg.seed,
                                                                          "stage2_fit", d)))
    return stage1, stage2

  def run_name(self, method: str, seed: int) -> str:
    """The Stage 3 run directory / evaluation row of (method, seed) (`RunPlan.rows`)."""
    return self.plan.runs[method].row(seed)

  def _stage3_config(self, method: str, seed: int) -> Stage3Config:
    """Run ``method`` at Stage 3 seed ``seed``: the job's `TrainConfig` as the run trains it
    (`MainConfig.run_train`), in its directory (`RunPlan.dirs`)."""
    spec, track = self.cfg.runs[method], self.cfg.track
    if spec.anchor != "fitted" and self.stage1_cfg.label_scale != "sum":
      raise ValueError(f"runs.{method}.anchor={spec.anchor!r} needs stage1.label_scale='sum' (the "
                       f"exact log Z is on the trajectory scale), got "
                       f"{self.stage1_cfg.label_scale!r}")
    try:
      return Stage3Config(
          workdir=str(self.plan.runs[method].dir(seed)),
          model=BackboneConfig(policy_path=self.ref_path, dtype="float32", remat=False,
                               attention_impl=self.cfg.attention_impl),
          data=DataConfig(train_path=self.train_prompts_path, reward="sum_task", rendering="plain",
                          anchor_path=self._anchor_path(spec),
                          replay_path=str(self.replicas[spec.data_seed][0].dataset_path())
                          if spec.replay.enabled else ""),
          engine=self.cfg.engine, mesh=self.mesh,
          train=self.cfg.run_train(method, seed, progress_bar=self.progress),
          exact_target=ExactTargetConfig(
              reference_path=self.ref_path if track.every else "", beta=self.cfg.beta,
              kl_samples=track.kl_samples, wrong_samples=track.wrong_samples,
              share_prompts=track.share_prompts, wrong_decode=track.wrong_decode,
              scorer_rows=track.scorer_rows,
              seed=seeds.run_seed(self.cfg.seed, "track", method, seed),
              heldout_path=self.heldout_prompts_path if track.heldout and track.every else ""),
          export_dtype="float32")  # tiny float32 models, measured exactly after export
    except (TypeError, ValueError) as e:
      raise ValueError(config_lib.qualify(str(e), f"runs.{method}")) from None

  def _sft_config(self) -> SftConfig:
    return SftConfig(reference_path=self.ref_path, stage1_path=str(self.stage1_cfg.dataset_path()),
                     out_path=str(self.dir / "sft"), mesh=self.mesh,
                     sft=_derived("sft", self.cfg.sft, seed=seeds.job_seed(self.cfg.seed, "sft")))

  def _eval_config(self, row: str, model_path: str) -> EvalConfig:
    """The evaluation of ``row``, its sampling seeds its own (`pipeline.seeds`: a Stage 3 run's
    from its method and Stage 3 seed, another row's from its name)."""
    e = self.cfg.eval
    run, stage3_seed = self.run_of_row.get(row, (row, None))
    seed_of = lambda stream: seeds.run_seed(self.cfg.seed, stream, run, stage3_seed)
    exact = dataclasses.replace(e.exact_target, reference_path=self.ref_path, beta=self.cfg.beta,
                                seed=seed_of("eval_exact"))
    return _derived(
        "eval", e, exact_target=exact, output_dir=str(self.dir / "eval" / row),
        model_path=model_path, label=row,
        benchmarks={"task": self.prompts_path} | (
            {"heldout": self.heldout_prompts_path} if self.cfg.heldout.enabled else {}),
        seed=seed_of("eval_sampling"),
        engine=dataclasses.replace(self.cfg.engine, separate_process=False))

  def _timed(self, name: str, fn, *args):
    t0 = time.time()
    out = fn(*args)
    self._record(name, round(time.time() - t0, 2))
    return out

  def _record(self, name: str, seconds: float) -> None:
    if name not in self.times:  # the time of the run that did the work (a resumed run skips it)
      self.times[name] = seconds
      artifacts.write_json(self.dir / "times.json", self.times)

  # -- 0. the task's own pieces ------------------------------------------------------------------

  def build_models(self) -> pinned.ModelSource:
    """pi_ref and p_T in ``models/``: the pinned ones (`pipeline.pinned`), or trained here with
    ``rebuild_models`` or where none are pinned; writes the prompt files."""
    source = pinned.provide(Path(self.ref_path).parent, pinned.identity(self.cfg),
                            rebuild=self.cfg.rebuild_models,
                            train=self._train_models)
    self.write_prompts()
    return source

  def _train_models(self) -> None:
    """Trains and saves pi_ref and p_T (each skipped when saved). A model is saved whole or not
    at all (`save_warmed_model`): a job killed mid-save leaves no model that a rerun would trust."""
    for path, spec, init in ((self.ref_path, self.cfg.reference_model, None),
                             (self.proposal_path, self.cfg.proposal_model, self.ref_path)):
      marker = Path(path) / MARKER
      if marker.exists():
        self._check_saved_model(marker, spec)
        continue
      model, summary = train_sum_model(
          self.task, self.arch, spec, init_from=from_pretrained(init) if init else None,
          progress=self.progress, desc=f"warm-up {Path(path).name}")
      save_warmed_model(model, path, self.tok,
                        {k: v for k, v in summary.items() if k != "losses"}
                        | {"spec": config_lib.to_dict(spec), "init_from": init,
                           "task": [self.task.n_min, self.task.n_max]})

  def _check_saved_model(self, marker: Path, spec: WarmupSpec) -> None:
    """A saved warm-up model is reused only if it was trained as this job would train it (its
    spec and the task's range; a marker from before the range was recorded is checked on its
    spec): a rerun with other settings never serves it."""
    saved = json.loads(marker.read_text())
    want = {"spec": config_lib.to_dict(spec), "task": [self.task.n_min, self.task.n_max]}
    diff = {k: (saved.get(k), v) for k, v in want.items()
            if k in saved and json.loads(json.dumps(saved[k])) != json.loads(json.dumps(v))}
    if diff:
      raise ValueError(f"{marker.parent} holds a model trained with other settings {diff} "
                       "((saved, wanted)); use another workdir or delete it")

  def write_prompts(self) -> None:
    """The prompt file, and with ``heldout`` its Stage 3 and held-out parts (kept when written;
    each written whole: a temporary file renamed into place)."""
    if not Path(self.prompts_path).exists():
      Path(self.prompts_path).parent.mkdir(parents=True, exist_ok=True)
      _save_prompts(prompt_records(self.task), self.prompts_path)
    if self.cfg.heldout.enabled and not Path(self.heldout_prompts_path).exists():
      train, held = split_values(self.task.ns, self.cfg.heldout.fraction, self.cfg.heldout.seed)
      recs = dict(zip(self.task.ns, prompt_records(self.task)))
      _save_prompts([recs[n] for n in train], self.train_prompts_path)
      _save_prompts([recs[n] for n in held], self.heldout_prompts_path)

  def exact(self) -> ExactTarget:
    """The exact log Z(q) of every prompt (`disa_jax.eval.exact`), cached in exact.json."""
    path = self.dir / "exact.json"
    if path.exists():
      return codec.load(ExactTarget, path, "the exact target")
    out = ExactTarget.from_logprobs(self._correct_set_logprobs(self.ref_path), self.cfg.beta)
    codec.save(out, path)
    return out

  def _correct_set_logprobs(self, model_path: str) -> dict[str, np.ndarray]:
    """``{prompt id: [C] trajectory log-probs of its correct answers}`` under a saved model."""
    scorer = SequenceScorer(models.from_pretrained(model_path), pad_id=self.tok.pad_token_id,
                            batch_size=64, pad_to=16)
    out = {}
    for rec in load_prompts(self.prompts_path):
      prompt = encode_prompt(self.tok, rec, "plain", max_len=self.stage1_cfg.max_prompt_len)
      answers = correct_set(self.tok, rec.reward_meta())
      out[rec.prompt_id] = np.asarray(scorer.sequence_logprobs([list(prompt)] * len(answers),
                                                               answers), np.float64)
    return out

  def conditional_kls(self, rows: Mapping[str, str]) -> ConditionalKLs:
    """Per row (name -> checkpoint), the preference among correct answers against the target's and
    the proposal's: KL(pi|c || pi~|c) (= pi_ref|c: the reward is binary) and KL(pi|c || p_T|c), per
    prompt and their means over the training and the held-out prompts (`ConditionalKLs`).

    Cached in conditional_kl.json per row: a row is computed again when it is missing there or its
    checkpoint is not the one it was scored from (`model_identity`), all rows when the prompts,
    pi_ref or p_T changed. Returns the rows asked for, in their order.
    """
    path = self.dir / ConditionalKLs.FILE
    self.write_prompts()  # (the ids as loaded: prefixed with the data source)
    ids = tuple(r.prompt_id for r in load_prompts(self.prompts_path))
    held = tuple(sorted({r.prompt_id for r in load_prompts(self.heldout_prompts_path)}
                        if self.cfg.heldout.enabled else ()))
    ref_id, prop_id = model_identity(self.ref_path), model_identity(self.proposal_path)
    kept = self._cached_conditional_kls(path, ids, ref_id, prop_id, rows)
    out = ConditionalKLs(path=path, prompt_ids=ids, heldout_prompt_ids=held,
                         reference_identity=ref_id, proposal_identity=prop_id, rows={})
    mask = out.heldout_mask()
    todo = [name for name in rows if name not in kept]
    if todo:
      ref = self._correct_set_logprobs(self.ref_path)
      prop = self._correct_set_logprobs(self.proposal_path)
      for name in todo:
        lp = self._correct_set_logprobs(rows[name])
        kept[name] = ConditionalKL(
            model_path=rows[name], model_identity=model_identity(rows[name]),
            kl_target=[conditional_kl(lp[p], ref[p]) for p in ids],
            kl_proposal=[conditional_kl(lp[p], prop[p]) for p in ids], heldout=mask)
    asked = {name: dataclasses.replace(kept[name], heldout=mask) for name in rows}
    others = {name: dataclasses.replace(row, heldout=mask) for name, row in kept.items()
              if name not in asked}
    dataclasses.replace(out, rows=asked | others).save()  # the saved rows not asked for are kept
    return dataclasses.replace(out, rows=asked)

  def _cached_conditional_kls(self, path: Path, ids: tuple[str, ...], ref_id: str, prop_id: str,
                              rows: Mapping[str, str]) -> dict[str, ConditionalKL]:
    """The rows of conditional_kl.json still valid (`ConditionalKLs.reusable`); none when the file
    is absent or unreadable (e.g. written before the rows were keyed by checkpoint)."""
    if not path.exists():
      return {}
    try:
      saved = ConditionalKLs.load(path)
    except artifacts.ArtifactError as e:
      warnings.warn(f"recomputing every conditional KL: {e}")
      return {}
    return saved.reusable(ids, ref_id, prop_id, rows)

  # -- 1-3. the workflows ------------------------------------------------------------------------

  def stage1(self, cfg: Stage1Config | None = None) -> Stage1Result:
    """`run_stage1` of the job's Stage 1 (or of ``cfg``: a data seed's)."""
    out = run_stage1(cfg or self.stage1_cfg)
    if out.preempted:  # its batches so far are saved; the job's rerun resumes Stage 1
      raise RuntimeError(f"Stage 1 {out.dataset} was stopped by a preemption signal; rerun the "
                         "job to resume")
    return out

  def replica_stages(self) -> dict[int, tuple[Stage1Data, AnchorArtifact]]:
    """Stage 1 and Stage 2 of every further data seed a run reads (`RunSpec.data_seed`), by d."""
    out = {}
    for d, (s1, s2) in self.replicas.items():
      if d:
        pool = self._timed(f"stage1_data{d}", self.stage1, s1).data()
        out[d] = (pool, self._timed(f"stage2_data{d}", run_stage2, s2))
    return out

  def nstudy(self) -> NStudyResult:
    """The App. C.3 command on the sum task (`launch/nstudy.py`'s workflow), in ``nstudy/``."""
    spec = self.cfg.nstudy
    return run_nstudy(NStudyConfig(
        stage1=self.stage1_cfg, output_dir=str(self.dir / "nstudy"), subset_size=spec.subset_size,
        pool_size=spec.pool_size, ms=self.cfg.n_study, repeats=spec.repeats, ks=spec.ks,
        seed=seeds.job_seed(self.cfg.seed, "nstudy"), embedding=self.stage2_cfg.embedding))

  def stage2(self) -> AnchorArtifact:
    """Stage 2, and the exact log Z as a table anchor (the oracle) when a run uses it."""
    anchor = run_stage2(self.stage2_cfg)
    if any(self.cfg.runs[m].anchor == "exact" for m in self.cfg.methods) and not (
        Path(self.exact_anchor_path) / TABLE_FILE).exists():  # (its file is written last)
      TableAnchor(self.exact().log_z_by_id(), beta=self.cfg.beta,
                  reward_transform=RewardTransform(kind="raw"),
                  label_scale=self.stage1_cfg.label_scale).save(self.exact_anchor_path)
    self._noise_anchors()
    return anchor

  def _noise_anchors(self) -> None:
    """The 'exact+noise' anchors of the runs (one table per sigma and data seed d, seeded by the
    job's seed + d)."""
    for sigma, d in sorted({(self.cfg.runs[m].sigma, self.cfg.runs[m].data_seed)
                            for m in self.cfg.methods if self.cfg.runs[m].anchor == "exact+noise"}):
      if (Path(self.noise_anchor_path(sigma, d)) / TABLE_FILE).exists():
        continue
      seed = seeds.job_seed(self.cfg.seed, "noise_anchor", d)
      table = noisy_log_z(self.exact().log_z_by_id(), sigma, seed)
      TableAnchor(table, beta=self.cfg.beta, reward_transform=RewardTransform(kind="raw"),
                  label_scale=self.stage1_cfg.label_scale,
                  source=f"exact+noise(sigma={sigma:g},seed={seed})").save(
                      self.noise_anchor_path(sigma, d))

  def anchor_study(self, pool: Stage1Data, anchor: AnchorArtifact) -> SigmaStudy | None:
    """sigma_g of each Stage 2 label / weighting variant against the exact log Z, written to
    anchor_study.json; the saved study when the file exists (a resumed job), None when it is off
    (``anchor_study.repeats`` = 0) and was never run."""
    path = self.dir / "anchor_study.json"
    if path.exists():
      return codec.load(SigmaStudy, path, "the anchor study")
    if not self.cfg.anchor_study.repeats:
      return None
    ids, emb = anchor.embeddings()  # Stage 2's cache, in the pool's order
    if ids != tuple(pool.prompt_ids):
      raise ValueError(f"the Stage 2 embedding cache of {anchor.output_dir} is not in the order of "
                       f"the Stage 1 pool {self.stage1_cfg.dataset_path()}")
    res = sigma_g_study(emb, pool, self.exact().log_z_of(pool.prompt_ids),
                        ns=self.cfg.n_study, folds=self.cfg.anchor_study.folds,
                        repeats=self.cfg.anchor_study.repeats, fit=self.stage2_cfg.fit,
                        seed=seeds.job_seed(self.cfg.seed, "anchor_study"))
    res = dataclasses.replace(res, verdict=sigma_verdict(res))
    codec.save(res, path)
    return res

  def stage3_units(self, todo: list[tuple[str, int]]) -> list[list[tuple[str, int]]]:
    """The (method, seed) runs of ``todo`` as units of work (`job_workers.stage3_units`): each
    method's seeds in chunks of at most ``seed_batch`` trained together, the most work first."""
    return job_workers.stage3_units(todo, lambda k: k[0], self.cfg.seed_batch,
                                    lambda k: self.stage3_cfgs[k].train.work)

  def stage3_all(self) -> dict[tuple[str, int], Stage3Run]:
    """Every (method, seed) run not yet exported (or without its summary), a unit of
    `stage3_units` at a time on each of ``stage3_workers`` workers; returns every run, by (method,
    seed).

    With one worker the units go one after another in this process. With more, each unit is a
    spawned process of its own (`job_workers.run_stage3_units`), the progress bars off; a failed
    unit raises here naming its runs, after the others finish. On a CPU host, two workers on two cores nearly halve Stage 3's wall time (a
    run's trainer and its engine worker alternate, so one run keeps about one core busy). Each run
    of a unit records the unit's seconds (its seeds ran together).
    """
    keys = [(m, s) for m in self.cfg.methods for s in self.cfg.run_seeds(m)]
    wd = {k: Path(self.stage3_cfgs[k].workdir) for k in keys}
    todo = [k for k in keys if not ((wd[k] / "final" / "export_info.json").exists()
                                    and (wd[k] / Stage3Run.FILE).exists())]
    units = self.stage3_units(todo)
    workers = min(self.cfg.stage3_workers, len(units))
    quiet = workers > 1 or any(len(u) > 1 for u in units)  # (one bar per process and run)
    bar = lambda c: dataclasses.replace(c, train=dataclasses.replace(
        c.train, progress_bar=c.train.progress_bar and not quiet))
    # The evaluation of the reference, the proposal and every run already exported fills the
    # workers the last runs leave idle (the default job's last run used one of two workers for
    # 55 s); the job's evaluation stage finds those rows done and evaluates the rest.
    early = [self._eval_config(row, path) for row, path in
             (("reference", self.ref_path), ("proposal", self.proposal_path))]
    ready: list[tuple[str, ...]] = [(), ()]
    for k in keys:
      final = wd[k] / "final"  # where `run_stage3` exports; its summary is written after
      early.append(self._eval_config(self.run_name(*k), str(final)))
      ready.append((str(final / "export_info.json"), str(wd[k] / Stage3Run.FILE)))
    job_workers.run_stage3_units(
        [[bar(self.stage3_cfgs[k]) for k in unit] for unit in units],
        [[self.run_name(*k) for k in unit] for unit in units], workers,
        lambda names, seconds: [self._record(f"stage3_{n}", seconds) for n in names],
        pin=self.cfg.pin_workers,
        then=functools.partial(job_workers.evaluate_ready, early, ready, self.ref_path),
        record_then=lambda seconds: [self._record(f"eval_{r}", s) for r, s in seconds.items()])
    return {k: Stage3Run.load(wd[k]) for k in keys}

  def lora_sft(self, pool: Stage1Data) -> SftRun | None:
    """The LoRA-SFT baseline; None (and `SFT_SKIPPED` in sft_skipped.json) without reward-1
    samples."""
    if not (pool.reward[pool.mask] >= 1.0).any():  # nothing to distil: say so in the report
      artifacts.write_json(self.dir / "sft_skipped.json", {"reason": SFT_SKIPPED})
      return None
    run = run_sft(self.sft_cfg)
    if not run.exported:  # adapters saved at that step; the job's rerun resumes the baseline
      raise RuntimeError(f"the LoRA-SFT baseline {run.out_path} was stopped by a preemption "
                         f"signal at step {run.preempted}; rerun the job to resume")
    return run

  # -- 4. evaluation and report ------------------------------------------------------------------

  def evaluate(self, rows: dict[str, str]) -> dict[str, EvalResult]:
    """`run_evaluation` of every row. With ``eval_workers`` > 1 the rows not yet evaluated are
    dealt round-robin to that many spawned processes first (`job_workers.evaluate_rows` in each: JAX
    never forks), their seconds recorded as each row's; then every row here, in order (an evaluated one
    is read back from its directory)."""
    cfgs = [self._eval_config(row, path) for row, path in rows.items()]
    record = lambda row, seconds: self._record(f"eval_{row}", seconds)
    job_workers.evaluate_in_workers(cfgs, self.ref_path, self.cfg.eval_workers, record,
                                    pin=self.cfg.pin_workers)
    out: dict[str, EvalResult] = {}
    for row, s in job_workers.evaluate_rows(cfgs, self.ref_path, out).items():
      record(row, s)
    return out

  def run(self) -> JobReport | AnchorReport:
    """Every stage of the module docstring (each skipped when its output exists), then the report.
    The job owns its workdir meanwhile (``job.lock``, naming its pid and preset).

    Returns:
      The report (`JobReport`: report.json and report.md in the job's directory).

    Raises:
      OutputLockedError: another job holds the workdir.
    """
    with OutputLock(self.dir / "job.lock", f"the main job's workdir {self.dir}",
                    note=f"preset {self.cfg.preset!r}"):
      return self._run()

  def _run(self) -> JobReport | AnchorReport:
    """`run` once the workdir is locked."""
    if self.cfg.compilation_cache:  # every process of the job compiles each program once
      runtime.persistent_compilation_cache(self.dir / "jax_cache")
    prov = provenance(self._timed("models", self.build_models))
    stage1 = self._timed("stage1", self.stage1)
    nstudy = self._timed("nstudy", self.nstudy) if self.cfg.nstudy.enabled else None
    exact = self._timed("exact_log_z", self.exact)
    anchor = self._timed("stage2", self.stage2)
    pool = stage1.data()
    study = self._timed("anchor_study", self.anchor_study, pool, anchor)
    if self.cfg.stages == "anchor":
      return write_anchor_report(self.plan, pool, anchor, exact, anchor_study=study,
                                 times=self.times, provenance=prov)
    replicas = self.replica_stages()
    stage3 = self.stage3_all()
    rows = {"reference": self.ref_path, "proposal": self.proposal_path} | {
        self.run_name(*k): str(run.export) for k, run in stage3.items()}
    skipped = {}
    if self.cfg.sft_enabled:
      sft = self._timed("lora_sft", self.lora_sft, pool)
      if sft is not None:
        rows["lora_sft"] = str(sft.out_path)
      else:
        skipped["lora_sft"] = SFT_SKIPPED
    preference = (self._timed("conditional_kl", self.conditional_kls, rows)
                  if self.cfg.conditional_kl else None)
    evals = self.evaluate(rows)
    return write_report(self.plan, ReportInputs(
        exact=exact, pool=pool, anchor=anchor, stage3=stage3, evals=evals, nstudy=nstudy,
        skipped=skipped, conditional_kl=preference, replicas=replicas, anchor_study=study,
        times=job_times(self.times, rows, self.replicas), provenance=prov))
