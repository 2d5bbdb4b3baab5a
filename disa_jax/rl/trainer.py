"""The Stage 3 loop: rollout, rewards, reference log-probs, update, weight sync, eval, checkpoint.

One RL step (Alg. 1, lines 10-13):

1. take the next P prompts from a deterministic, epoch-shuffled `PromptStream`;
2. sample G responses per prompt with the rollout `Engine` (its own process in production);
3. score them with the reward function; transform rewards (TB methods) or z-score them into group
   advantages (GRPO / GSPO, eq. 3);
4. score pi_ref (frozen reference copy) and, with ``old_logp_source='recompute'``, pi_old (the
   policy before this step's updates) through `disa_jax.scoring`; DISA queries the frozen anchor
   on the reference model's prompt embeddings;
5. run ``num_minibatches`` optimizer updates over the rollout batch (`disa_jax.rl.train_step`);
6. push the new policy weights (HF names; never the FlowRL head) to the engine;
7. evaluate every ``eval.every`` steps and checkpoint every ``checkpoint.every`` steps.

Metrics go to ``<workdir>/metrics.jsonl`` and TensorBoard; a tqdm bar shows the ETA. A run resumes
from the latest checkpoint in ``<workdir>/checkpoints`` automatically.
"""
from __future__ import annotations

import dataclasses
import hashlib
import time
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from disa_jax import models, parallel
from disa_jax.checkpoint import CheckpointManager, array_to_rng, rng_to_array
from disa_jax.data.batching import pack_sequences
from disa_jax.rl import losses
from disa_jax.rl import train_step as ts
from disa_jax.rl.config import TrainConfig
from disa_jax.rl.logz_head import LogZHead
from disa_jax.rl.metrics import MetricsLogger
from disa_jax.rollout.types import Completion, Engine, SamplingParams

# (prompt items [B], responses [B] token ids) -> [B] float32 rewards
RewardFn = Callable[[Sequence["PromptItem"], Sequence[np.ndarray]], np.ndarray]


@dataclasses.dataclass(frozen=True)
class PromptItem:
  """A tokenised training prompt.

  Attributes:
    prompt_id: stable id.
    token_ids: the rendered prompt's token ids.
    meta: what the reward function needs (ground truth, tests, ...).
  """
  prompt_id: str
  token_ids: tuple[int, ...]
  meta: Mapping[str, Any] = dataclasses.field(default_factory=dict)


class PromptStream:
  """Batches of prompts in a seeded order that depends only on the batch index (resumable).

  Batch k holds the prompts at global positions [k P, (k + 1) P) of the concatenation of epoch
  orders; epoch e's order is a permutation drawn from (seed, e) (or the file order if not shuffled).
  """

  def __init__(self, items: Sequence[PromptItem], batch_size: int, *, seed: int, shuffle: bool,
               max_prompt_len: int):
    if not items:
      raise ValueError("PromptStream needs at least one prompt, got 0")
    if batch_size < 1:
      raise ValueError(f"PromptStream batch_size must be >= 1, got {batch_size}")
    for it in items:
      if not 0 < len(it.token_ids) <= max_prompt_len:
        raise ValueError(f"prompt {it.prompt_id!r} has {len(it.token_ids)} tokens; "
                         f"rollout.max_prompt_len={max_prompt_len}")
    self.items = list(items)
    self.batch_size = batch_size
    self.seed = seed
    self.shuffle = shuffle
    self._orders: dict[int, np.ndarray] = {}

  def _order(self, epoch: int) -> np.ndarray:
    if epoch not in self._orders:
      n = len(self.items)
      self._orders = {epoch: (np.random.default_rng([self.seed, epoch]).permutation(n)
                              if self.shuffle else np.arange(n))}
    return self._orders[epoch]

  def batch(self, k: int) -> list[PromptItem]:
    n = len(self.items)
    out = []
    for g in range(k * self.batch_size, (k + 1) * self.batch_size):
      out.append(self.items[self._order(g // n)[g % n]])
    return out


def _derive_seed(*parts: Any) -> int:
  digest = hashlib.sha256(repr(parts).encode()).digest()
  return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def evaluate(engine: Engine, items: Sequence[PromptItem], reward_fn: RewardFn, *, n: int,
             temperature: float, top_p: float, max_tokens: int, stop_token_ids: tuple[int, ...],
             seed: int) -> dict[str, float]:
  """Mean@n (mean reward over n samples per prompt) and pass@n of the current engine weights."""
  params = SamplingParams(n=n, temperature=temperature, top_p=top_p, max_tokens=max_tokens,
                          stop_token_ids=stop_token_ids, seed=seed)
  comps = engine.generate([list(it.token_ids) for it in items], params)
  flat_items = [it for it in items for _ in range(n)]
  flat = [c.token_ids for group in comps for c in group]
  r = np.asarray(reward_fn(flat_items, flat), np.float32).reshape(len(items), n)  # [P*n] -> [P, n]
  return {
      f"eval/mean@{n}": float(r.mean()),
      f"eval/pass@{n}": float((r.max(-1) > 0.5).mean()),
      "eval/response_length": float(np.mean([len(t) for t in flat])),
  }


class Trainer:
  """Runs a Stage 3 experiment (see the module docstring).

  Args:
    cfg: the validated run config.
    workdir: run directory (metrics, TensorBoard, checkpoints).
    policy: the trained `Transformer` (initialised from pi_ref's weights; updated in place).
    reference: the frozen pi_ref `Transformer`.
    engine: the rollout engine; it must start with the policy's weights.
    prompts: training prompts.
    reward_fn: ``(items [B], response ids [B]) -> [B]`` rewards.
    stop_token_ids: tokens that end a response (EOS).
    pad_id: padding token id.
    anchor: the frozen `disa_jax.anchor.Anchor` (DISA only); checked against the run once.
    eval_prompts: prompts for periodic evaluation (``cfg.eval``).
    mesh: device mesh (default: one built from ``cfg.mesh``).
    logprob_fn: token log-prob function (default `disa_jax.scoring.token_logprobs`).
    pad_to: sequence lengths are padded to a multiple of this (fewer recompilations).
  """

  def __init__(self,
               cfg: TrainConfig,
               workdir: str,
               *,
               policy: models.Transformer,
               reference: models.Transformer,
               engine: Engine,
               prompts: Sequence[PromptItem],
               reward_fn: RewardFn,
               stop_token_ids: tuple[int, ...],
               pad_id: int,
               anchor: Any = None,
               eval_prompts: Sequence[PromptItem] = (),
               mesh: jax.sharding.Mesh | None = None,
               logprob_fn: ts.LogprobFn | None = None,
               pad_to: int = 64):
    self.cfg = cfg
    self.workdir = workdir
    self.engine = engine
    self.reward_fn = reward_fn
    self.stop_token_ids = tuple(stop_token_ids)
    self.pad_id = pad_id
    self.pad_to = pad_to
    self.eval_prompts = list(eval_prompts)
    lc, rc = cfg.loss, cfg.rollout
    if lc.method == "disa":
      if anchor is None:
        raise ValueError("method 'disa' needs the frozen anchor, got anchor=None")
      anchor.check_compatible(beta=lc.beta, reward_transform=lc.reward_transform,
                              label_scale=lc.label_scale,
                              embedding_dim=reference.config.hidden_size)
    elif anchor is not None:
      raise ValueError(f"an anchor was given but loss.method={lc.method!r} does not use one")
    self.anchor = anchor
    self.stream = PromptStream(prompts, rc.prompts_per_batch, seed=cfg.seed,
                               shuffle=cfg.data.shuffle, max_prompt_len=rc.max_prompt_len)
    self.mesh = mesh if mesh is not None else parallel.make_mesh(
        cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor)
    batch_shards = self.mesh.shape["data"] * self.mesh.shape["fsdp"]
    if rc.micro_batch_size % batch_shards:
      raise ValueError(f"rollout.micro_batch_size={rc.micro_batch_size} must be divisible by the "
                       f"mesh's data x fsdp = {batch_shards} batch shards")
    parallel.shard_model(policy, self.mesh, parallel.TRAIN_RULES)
    parallel.shard_model(reference, self.mesh, parallel.TRAIN_RULES)
    self.policy = policy
    oc = cfg.optim
    optimizer = ts.make_optimizer(oc.lr, weight_decay=oc.weight_decay, b1=oc.b1, b2=oc.b2,
                                  eps=oc.eps, grad_clip=oc.grad_clip,
                                  warmup_steps=oc.warmup_steps)
    head = head_opt = None
    if lc.method == "flowrl":
      head = LogZHead(policy.config.hidden_size, lc.logz_head_layers,
                      rngs=nnx.Rngs(_derive_seed(cfg.seed, "logz_head")),
                      init_bias=lc.logz_head_init)
      head_opt = ts.make_optimizer(lc.logz_head_lr, weight_decay=oc.weight_decay, b1=oc.b1,
                                   b2=oc.b2, eps=oc.eps, grad_clip=oc.grad_clip,
                                   warmup_steps=oc.warmup_steps)
    self.graphdef, head_graphdef, self.state, shardings = ts.init_train_state(
        policy, optimizer, head, head_opt, mesh=self.mesh)
    settings = lc
    self.update = ts.make_train_step(
        self.graphdef, settings, optimizer, head_graphdef=head_graphdef, head_optimizer=head_opt,
        logprob_fn=logprob_fn, prompt_width=rc.max_prompt_len, mesh=self.mesh,
        state_shardings=shardings)
    self.score = ts.make_scoring_fn(self.graphdef, logprob_fn)
    self.ref_params = nnx.state(reference, nnx.Param)
    ref_graphdef = nnx.graphdef(reference)
    self._embed = jax.jit(lambda p, ids, m: _prompt_embeddings(nnx.merge(ref_graphdef, p), ids, m))
    self.rng = jax.random.key(cfg.seed)
    self.ckpt = CheckpointManager(f"{workdir}/checkpoints", max_to_keep=cfg.checkpoint.keep,
                                  async_save=cfg.checkpoint.async_save)
    self.start_step = 0
    latest = self.ckpt.latest_step()
    if latest is not None:
      self._restore(latest)
    self.logger = MetricsLogger(workdir, resume_step=latest, tensorboard=cfg.tensorboard)

  # ------------------------------------------------------------------------------------------
  # checkpoints
  # ------------------------------------------------------------------------------------------

  def _ckpt_state(self) -> dict[str, Any]:
    s = self.state
    out = {"step": s.step, "params": nnx.to_pure_dict(s.params), "opt_state": s.opt_state,
           "rng": rng_to_array(self.rng)}
    if s.head_params is not None:
      out["head_params"] = nnx.to_pure_dict(s.head_params)
      out["head_opt_state"] = s.head_opt_state
    return out

  def save(self, step: int) -> None:
    self.ckpt.save(step, self._ckpt_state(),
                   {"rl_step": step, "data_position": step, "config": self.cfg.to_dict()},
                   force=True)

  def _restore(self, step: int) -> None:
    _, restored, meta = self.ckpt.restore(self._ckpt_state(), step)
    if meta["data_position"] != step:
      raise ValueError(f"checkpoint {step}: data_position {meta['data_position']} != step")
    saved, now = meta["config"], self.cfg.to_dict()
    if saved["seed"] != now["seed"]:
      raise ValueError(f"cannot resume {self.workdir}: checkpoint {step} was written with "
                       f"seed={saved['seed']!r}, this run has {now['seed']!r}")
    for section in ("model", "loss", "rollout", "data"):
      for key, value in now[section].items():
        if saved[section].get(key) != value:
          raise ValueError(f"cannot resume {self.workdir}: checkpoint {step} was written with "
                           f"{section}.{key}={saved[section].get(key)!r}, this run has {value!r}")
    params = self.state.params
    nnx.replace_by_pure_dict(params, restored["params"])
    head_params = self.state.head_params
    if head_params is not None:
      nnx.replace_by_pure_dict(head_params, restored["head_params"])
    self.state = ts.TrainState(restored["step"], params, restored["opt_state"], head_params,
                               restored.get("head_opt_state"))
    self.rng = array_to_rng(restored["rng"])
    self.start_step = step
    self._sync_weights()

  def _sync_weights(self) -> None:
    """Pushes the policy (never the FlowRL head) to the engine in HF names and layouts."""
    nnx.update(self.policy, self.state.params)
    self.engine.update_weights(models.to_hf_state_dict(self.policy, dtype=self.cfg.model.dtype))

  # ------------------------------------------------------------------------------------------
  # one RL step
  # ------------------------------------------------------------------------------------------

  def _score_batched(self, params, batch: Mapping[str, np.ndarray]) -> np.ndarray:
    mb = self.cfg.rollout.micro_batch_size
    rows = batch["input_ids"].shape[0]
    out = []
    for i in range(0, rows, mb):
      out.append(np.asarray(self.score(params, batch["input_ids"][i:i + mb],
                                       batch["attention_mask"][i:i + mb])))
    return np.concatenate(out, 0)

  def _anchor_log_z(self, items: Sequence[PromptItem]) -> np.ndarray:
    packed = pack_sequences([list(it.token_ids) for it in items], [[] for _ in items],
                            pad_id=self.pad_id, pad_to=self.pad_to)
    emb = self._embed(self.ref_params, packed["input_ids"], packed["prompt_mask"])
    return np.asarray(self.anchor(emb), np.float32)  # [P]

  def rollout(self, step: int) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """Samples, scores and packs the rollout batch of RL step ``step``."""
    cfg, rc = self.cfg, self.cfg.rollout
    items = self.stream.batch(step)
    g = rc.group_size
    self.rng, sample_key = jax.random.split(self.rng)
    seed = int(jax.random.randint(sample_key, (), 0, 2**31 - 1))
    params = SamplingParams(n=g, temperature=rc.temperature, top_p=rc.top_p, top_k=rc.top_k,
                            max_tokens=rc.max_response_len, stop_token_ids=self.stop_token_ids,
                            seed=seed, return_raw_logprobs=rc.old_logp_source == "engine")
    t0 = time.perf_counter()
    comps: list[list[Completion]] = self.engine.generate([list(it.token_ids) for it in items],
                                                         params)
    t_gen = time.perf_counter() - t0
    flat = [c for group in comps for c in group]  # prompt-major [P * G]
    flat_items = [it for it in items for _ in range(g)]
    reward = np.asarray(self.reward_fn(flat_items, [c.token_ids for c in flat]), np.float32)
    if reward.shape != (len(flat),):
      raise ValueError(f"reward_fn returned shape {reward.shape}, expected ({len(flat)},)")
    batch = pack_sequences([list(it.token_ids) for it in flat_items],
                           [c.token_ids.tolist() for c in flat], pad_id=self.pad_id,
                           pad_to=self.pad_to)
    batch = {k: v for k, v in batch.items()}
    batch["response_mask"] = batch["response_mask"].astype(np.float32)
    batch["prompt_mask"] = batch["prompt_mask"].astype(np.float32)
    batch["ref_logp"] = self._score_batched(self.ref_params, batch)
    if rc.old_logp_source == "recompute":
      batch["old_logp"] = self._score_batched(self.state.params, batch)
    else:
      old = np.zeros(batch["input_ids"].shape, np.float32)
      for i, (it, c) in enumerate(zip(flat_items, flat)):
        start = len(it.token_ids)
        old[i, start:start + len(c.token_ids)] = c.raw_logprobs
      batch["old_logp"] = old
    grouped = reward.reshape(len(items), g)  # [P * G] -> [P, G]
    lc = cfg.loss
    batch["reward"] = np.asarray(lc.reward_transform.apply(grouped)).reshape(-1)  # [P, G] -> [B]
    batch["advantage"] = np.asarray(losses.group_zscore_advantages(grouped)).reshape(-1)
    if lc.method == "disa":
      batch["log_z"] = np.repeat(self._anchor_log_z(items), g)  # [P] -> [P * G]
    else:
      batch["log_z"] = np.zeros(len(flat), np.float32)
    lengths = np.array([len(c.token_ids) for c in flat])
    sampled_lp = np.concatenate([c.logprobs for c in flat])
    stats = {
        "reward": float(reward.mean()),
        "accuracy": float((reward > 0.5).mean()),
        "response_length": float(lengths.mean()),
        "response_length_max": float(lengths.max()),
        "truncated_frac": float(np.mean([c.finish_reason == "length" for c in flat])),
        # Monte-Carlo entropy estimate of the sampling distribution: -E[log p(sampled token)].
        "entropy": float(-sampled_lp.mean()),
        "reward_std_in_group": float(grouped.std(-1).mean()),
        "time/generate_s": t_gen,
        "tokens_generated": float(lengths.sum()),
    }
    return batch, stats

  def train_on(self, step: int, batch: Mapping[str, np.ndarray]) -> dict[str, float]:
    """``num_minibatches`` updates over the rollout batch, rows shuffled with the step's seed."""
    rc = self.cfg.rollout
    rows = batch["input_ids"].shape[0]
    order = np.random.default_rng([self.cfg.seed, step, 17]).permutation(rows)
    size = rows // rc.num_minibatches
    collected: list[dict[str, float]] = []
    for m in range(rc.num_minibatches):
      idx = order[m * size:(m + 1) * size]
      mini = {k: v[idx] for k, v in batch.items() if k in ts.TOKEN_FIELDS + ts.ROW_FIELDS}
      self.state, metrics = self.update(self.state, ts.split_micro_batches(mini,
                                                                           rc.micro_batch_size))
      collected.append({k: float(v) for k, v in jax.device_get(metrics).items()})
    out = {}
    for k in collected[0]:
      vals = [c[k] for c in collected]
      out[k] = max(vals) if k.endswith("_max") else min(vals) if k.endswith("_min") else float(
          np.mean(vals))
    return out

  def run(self) -> list[dict[str, float]]:
    """Trains from the current step to ``total_steps``; returns the metrics of the steps run."""
    cfg = self.cfg
    from tqdm.auto import tqdm  # pylint: disable=g-import-not-at-top
    bar = tqdm(total=cfg.total_steps, initial=self.start_step, disable=not cfg.progress_bar,
               desc=f"stage3/{cfg.loss.method}", unit="step")
    history = []
    try:
      for step in range(self.start_step, cfg.total_steps):
        t0 = time.perf_counter()
        batch, stats = self.rollout(step)
        t1 = time.perf_counter()
        train_metrics = self.train_on(step, batch)
        t2 = time.perf_counter()
        self._sync_weights()
        t3 = time.perf_counter()
        done = step + 1
        metrics = {**stats, **train_metrics}
        metrics["time/rollout_s"] = t1 - t0
        metrics["time/train_s"] = t2 - t1
        metrics["time/sync_s"] = t3 - t2
        metrics["time/step_s"] = t3 - t0
        trained_tokens = float(np.asarray(batch["attention_mask"]).sum())
        metrics["tokens_per_s"] = (trained_tokens) / max(t3 - t0, 1e-9)
        if cfg.eval.every and self.eval_prompts and done % cfg.eval.every == 0:
          ec = cfg.eval
          metrics.update(evaluate(self.engine, self.eval_prompts, self.reward_fn, n=ec.n,
                                  temperature=ec.temperature, top_p=ec.top_p,
                                  max_tokens=ec.max_tokens, stop_token_ids=self.stop_token_ids,
                                  seed=_derive_seed(cfg.seed, "eval", done)))
        if done % cfg.log_every == 0 or done == cfg.total_steps:
          self.logger.write(done, metrics)
        if done % cfg.checkpoint.every == 0 or done == cfg.total_steps:
          self.save(done)
        history.append(metrics)
        bar.update(1)
        bar.set_postfix(reward=f"{metrics['reward']:.3f}", loss=f"{metrics['loss']:.3g}")
    finally:
      bar.close()
      self.ckpt.wait_until_finished()
      self.logger.flush()
    return history

  def close(self) -> None:
    self.ckpt.close()
    self.logger.close()


def _prompt_embeddings(model: models.Transformer, ids: jax.Array, prompt_mask: jax.Array):
  from disa_jax import scoring  # pylint: disable=g-import-not-at-top
  return scoring.prompt_embeddings(model, ids, jnp.asarray(prompt_mask, jnp.int32))
