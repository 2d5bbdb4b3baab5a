"""The Stage 3 loop: rollout, rewards, reference log-probs, update, weight sync, eval, checkpoint.

One RL step (Alg. 1, lines 10-13):

1. take the next P prompts from a deterministic, epoch-shuffled `PromptStream`;
2. sample G responses per prompt with the rollout `Engine` (its own process in production);
3. score them with the reward function; transform rewards (TB methods) or z-score them into group
   advantages (GRPO / GSPO, eq. 3);
4. score pi_ref (frozen reference copy; skipped for GRPO / GSPO without a KL penalty) and, with
   ``old_logp_source='recompute'`` and several mini-batches, pi_old (the policy before this step's
   updates) through `disa_jax.scoring` (with one mini-batch pi_old is the policy of the update's own
   forward pass); DISA queries the frozen anchor on the reference model's prompt embeddings;
5. run ``num_minibatches`` optimizer updates over the rollout batch (`disa_jax.rl.train_step`);
6. push the new policy weights (HF names; never the FlowRL head) to the engine;
7. evaluate every ``eval.every`` steps and checkpoint every ``checkpoint.every`` steps.

With Stage 1 replay (``cfg.replay``, DISA / FlowRL), step 2 samples G - k responses per prompt and
k come from the Stage 1 pool (`disa_jax.rl.replay`); they are scored like the others.

Multi-host (``jax.process_count() > 1``, see `disa_jax.parallel.distributed`): every process runs
this same loop on the same global mesh. The host leaders' generation processes each sample a
contiguous slice of the step's prompts (``SamplingParams.prompt_index_offset`` keeps the samples
those of a single engine), grade them, and all-gather the completions, so every process then holds
the whole rollout batch in NumPy and feeds only its own rows to the jitted scoring and update
functions. New weights are gathered into a host copy on every process and pushed by each host
leader into its own generation process. Checkpoints go through orbax's multi-process path; only
process 0 writes metrics.

Metrics go to ``<workdir>/metrics.jsonl`` and TensorBoard; a tqdm bar shows the ETA. A run resumes
from the latest checkpoint in ``<workdir>/checkpoints`` automatically. The sampling seed of step k
is derived from (seed, k), so a resumed run samples what an uninterrupted one would.
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
from disa_jax.checkpoint import CheckpointManager
from disa_jax.data.batching import pack_sequences
from disa_jax.parallel import distributed
from disa_jax.rl import losses
from disa_jax.rl import train_step as ts
from disa_jax.rl.config import TrainConfig
from disa_jax.rl.logz_head import LogZHead
from disa_jax.rl.metrics import MetricsLogger
from disa_jax.rl.replay import ReplayPool, ReplaySample, replay_count
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


def grade(reward_fn: RewardFn, items: Sequence[PromptItem],
          comps: Sequence[Sequence[Completion]]) -> np.ndarray:
  """``[P, n]`` float32 rewards of ``comps`` (``[P][n]``) through ``reward_fn``, shape-checked."""
  flat_items = [it for it, group in zip(items, comps) for _ in group]
  flat = [c.token_ids for group in comps for c in group]
  r = np.asarray(reward_fn(flat_items, flat), np.float32)
  if r.shape != (len(flat),):
    raise ValueError(f"reward_fn returned shape {r.shape}, expected ({len(flat)},)")
  return r.reshape(len(items), -1) if len(items) else r.reshape(0, 0)  # [P * n] -> [P, n]


def _eval_metrics(rewards: np.ndarray, lengths: Sequence[int]) -> dict[str, float]:
  n = rewards.shape[1]
  return {
      f"eval/mean@{n}": float(rewards.mean()),
      f"eval/pass@{n}": float((rewards.max(-1) > 0.5).mean()),
      "eval/response_length": float(np.mean(lengths)),
  }


def evaluate(engine: Engine, items: Sequence[PromptItem], reward_fn: RewardFn, *, n: int,
             temperature: float, top_p: float, max_tokens: int, stop_token_ids: tuple[int, ...],
             seed: int) -> dict[str, float]:
  """Mean@n (mean reward over n samples per prompt) and pass@n of the current engine weights."""
  params = SamplingParams(n=n, temperature=temperature, top_p=top_p, max_tokens=max_tokens,
                          stop_token_ids=stop_token_ids, seed=seed)
  comps = engine.generate([list(it.token_ids) for it in items], params)
  r = grade(reward_fn, items, comps)
  return _eval_metrics(r, [len(c.token_ids) for group in comps for c in group])


class Trainer:
  """Runs a Stage 3 experiment (see the module docstring).

  Args:
    cfg: the validated run config.
    workdir: run directory (metrics, TensorBoard, checkpoints).
    policy: the trained `Transformer` (initialised from pi_ref's weights; updated in place).
    reference: the frozen pi_ref `Transformer`.
    engine: the rollout engine; it must start with the policy's weights. In a multi-process run,
      each host leader passes its host's engine and the other processes None.
    prompts: training prompts.
    reward_fn: ``(items [B], response ids [B]) -> [B]`` rewards.
    stop_token_ids: tokens that end a response (EOS).
    pad_id: padding token id.
    anchor: the frozen `disa_jax.anchor.Anchor` (DISA only); checked against the run once.
    eval_prompts: prompts for periodic evaluation (``cfg.eval``).
    mesh: device mesh (default: one built from ``cfg.mesh``).
    logprob_fn: token log-prob function (default `disa_jax.scoring.token_logprobs`).
    pad_to: sequence lengths are padded to a multiple of this (fewer recompilations).
    replay_pool: Stage 1 samples for ``cfg.replay`` (default: read from ``cfg.replay.path``).
  """

  def __init__(self,
               cfg: TrainConfig,
               workdir: str,
               *,
               policy: models.Transformer,
               reference: models.Transformer,
               engine: Engine | None,
               prompts: Sequence[PromptItem],
               reward_fn: RewardFn,
               stop_token_ids: tuple[int, ...],
               pad_id: int,
               anchor: Any = None,
               eval_prompts: Sequence[PromptItem] = (),
               mesh: jax.sharding.Mesh | None = None,
               logprob_fn: ts.LogprobFn | None = None,
               pad_to: int = 64,
               replay_pool: ReplayPool | None = None):
    self.cfg = cfg
    self.workdir = workdir
    self.engine = engine
    self.reward_fn = reward_fn
    self.stop_token_ids = tuple(stop_token_ids)
    self.pad_id = pad_id
    self.pad_to = pad_to
    self.eval_prompts = list(eval_prompts)
    lc, rc = cfg.loss, cfg.rollout
    self.leaders = distributed.host_leaders()
    if engine is None and jax.process_index() in self.leaders:
      raise ValueError(f"process {jax.process_index()} leads its host's generation but engine=None")
    self.replay = None
    if cfg.replay.enabled:
      self.replay = replay_pool or ReplayPool.from_stage1(cfg.replay.path,
                                                          max_response_len=rc.max_response_len)
      if self.replay.coverage([it.prompt_id for it in prompts]) == 0:
        raise ValueError(f"replay.path={cfg.replay.path!r}: none of the {len(prompts)} training "
                         "prompt ids has a Stage 1 sample")
    elif replay_pool is not None:
      raise ValueError("a replay_pool was given but replay.fraction=0")
    self._replay_checked = False
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
    # Passes the step can skip: the reference when nothing reads it (GRPO / GSPO without a KL
    # penalty), and pi_old's scoring when the batch gets one on-policy update (pi_old = pi_theta).
    self._use_ref = lc.method in ("disa", "flowrl") or lc.kl_coef > 0
    self._old_in_update = rc.num_minibatches == 1 and rc.old_logp_source == "recompute"
    self.update = ts.make_train_step(
        self.graphdef, lc, optimizer, head_graphdef=head_graphdef, head_optimizer=head_opt,
        logprob_fn=logprob_fn, prompt_width=rc.max_prompt_len, mesh=self.mesh,
        state_shardings=shardings, on_policy_old_logp=self._old_in_update,
        use_ref=self._use_ref)
    self.score = ts.make_scoring_fn(self.graphdef, logprob_fn)
    self.ref_params = nnx.state(reference, nnx.Param)
    ref_graphdef = nnx.graphdef(reference)
    self._embed = jax.jit(lambda p, ids, m: _prompt_embeddings(nnx.merge(ref_graphdef, p), ids, m))
    self._n_batch_shards = batch_shards
    self._row_sharding = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec(
        ts.BATCH_AXES))  # [B, ...] rows over the batch axes
    self._micro_sharding = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec(
        None, ts.BATCH_AXES))  # [K, b, ...] micro-batches: rows of each over the batch axes
    self.ckpt = CheckpointManager(f"{workdir}/checkpoints", max_to_keep=cfg.checkpoint.keep,
                                  async_save=cfg.checkpoint.async_save)
    self.start_step = 0
    latest = self.ckpt.latest_step()
    if latest is not None:
      self._restore(latest)
    self.logger = (MetricsLogger(workdir, resume_step=latest, tensorboard=cfg.tensorboard)
                   if distributed.is_main_process() else None)

  # ------------------------------------------------------------------------------------------
  # checkpoints
  # ------------------------------------------------------------------------------------------

  def _ckpt_state(self) -> dict[str, Any]:
    s = self.state
    out = {"step": s.step, "params": nnx.to_pure_dict(s.params), "opt_state": s.opt_state}
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
    # A checkpoint from before replay existed ran without it.
    saved.setdefault("replay", dataclasses.asdict(type(self.cfg.replay)()))
    for section in ("model", "loss", "rollout", "data", "replay"):
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
    self.start_step = step
    self._sync_weights()

  def _sync_weights(self) -> None:
    """Pushes the policy (never the FlowRL head) to the engine in HF names and layouts."""
    nnx.update(self.policy, self.state.params)
    # Collective across processes: a host copy on every process, pushed by each host leader.
    distributed.push_weights(self.policy, self.engine, dtype=self.cfg.model.dtype)

  # ------------------------------------------------------------------------------------------
  # one RL step
  # ------------------------------------------------------------------------------------------

  def _score_batched(self, params, batch: Mapping[str, np.ndarray]) -> np.ndarray:
    """``[B, T]`` token log-probs of the rows of ``batch`` in micro-batches (on every process)."""
    mb = self.cfg.rollout.micro_batch_size
    rows = batch["input_ids"].shape[0]
    out = []
    for i in range(0, rows, mb):
      chunk = distributed.to_global({"ids": batch["input_ids"][i:i + mb],
                                     "mask": batch["attention_mask"][i:i + mb]},
                                    self._row_sharding)
      out.append(distributed.replicate_to_hosts(self.score(params, chunk["ids"], chunk["mask"])))
    return np.concatenate(out, 0)

  def _anchor_log_z(self, items: Sequence[PromptItem]) -> np.ndarray:
    prompts = [list(it.token_ids) for it in items]
    # Every batch shard needs rows: pad with copies of the first prompt, dropped below.
    prompts += [prompts[0]] * (-len(prompts) % self._n_batch_shards)
    packed = pack_sequences(prompts, [[] for _ in prompts], pad_id=self.pad_id, pad_to=self.pad_to)
    glob = distributed.to_global({"ids": packed["input_ids"], "mask": packed["prompt_mask"]},
                                 self._row_sharding)
    emb = distributed.replicate_to_hosts(self._embed(self.ref_params, glob["ids"], glob["mask"]))
    return np.asarray(self.anchor(emb), np.float32)[:len(items)]  # [P]

  def _generate(self, items: Sequence[PromptItem], params: SamplingParams
                ) -> tuple[list[list[Completion]], np.ndarray, float]:
    """Samples ``params.n`` responses per item and grades them where the engines are.

    Returns:
      (``[P][n]`` completions, ``[P, n]`` rewards, this process's generation seconds), the same
      on every process.
    """
    n = params.n
    sl = distributed.leader_slice(len(items), self.leaders)  # all items in a single process
    local_items = list(items[sl])
    comps, rewards, t_gen = [], np.zeros((0,), np.float32), 0.0
    if local_items:
      t0 = time.perf_counter()
      comps = self.engine.generate([list(it.token_ids) for it in local_items],
                                   dataclasses.replace(params, prompt_index_offset=sl.start))
      t_gen = time.perf_counter() - t0
      rewards = grade(self.reward_fn, local_items, comps)
    flat, r = distributed.allgather_completions([c for g in comps for c in g], rewards.reshape(-1))
    return ([flat[i * n:(i + 1) * n] for i in range(len(items))],  # [P * n] -> [P][n]
            r.reshape(len(items), n), t_gen)

  def _draw_replay(self, step: int, items: Sequence[PromptItem]) -> list[list[ReplaySample]]:
    if self.replay is None:
      return [[] for _ in items]
    k = replay_count(self.cfg.replay.fraction_at(step), self.cfg.rollout.group_size)
    return self.replay.draw([it.prompt_id for it in items], k,
                            seed=_derive_seed(self.cfg.seed, "replay", step))

  def rollout(self, step: int) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """Samples, scores and packs the rollout batch of RL step ``step``.

    Rows are prompt-major ``[P * G]``; within a prompt's group the on-policy samples come first
    and the replayed Stage 1 samples (if any) last.
    """
    cfg, rc = self.cfg, self.cfg.rollout
    items = self.stream.batch(step)
    g = rc.group_size
    seed = _derive_seed(cfg.seed, "rollout", step)
    params = SamplingParams(n=g, temperature=rc.temperature, top_p=rc.top_p, top_k=rc.top_k,
                            max_tokens=rc.max_response_len, stop_token_ids=self.stop_token_ids,
                            seed=seed, return_raw_logprobs=rc.old_logp_source == "engine")
    replayed = self._draw_replay(step, items)
    k = max(len(r) for r in replayed)
    # On-policy samples: G - k for prompts with replay rows, G for the others (a second call).
    comps, rewards, t_gen = self._generate(items, dataclasses.replace(params, n=g - k))
    groups = [list(c) for c in comps]  # [P][on-policy samples]
    group_r = [list(r) for r in rewards]
    full = [i for i, r in enumerate(replayed) if not r]
    if k and full:
      extra, extra_r, t_extra = self._generate(
          [items[i] for i in full], dataclasses.replace(params, n=k, seed=seed + 1))
      t_gen += t_extra
      for i, e, er in zip(full, extra, extra_r):
        groups[i] += e
        group_r[i] += list(er)
    on_comps = [c for group in groups for c in group]
    rows_resp: list[np.ndarray] = []
    rows_reward: list[float] = []
    is_replay: list[bool] = []
    engine_lp: list[np.ndarray | None] = []
    for group, r, rep in zip(groups, group_r, replayed):
      rows_resp += [c.token_ids for c in group] + [s.token_ids for s in rep]
      rows_reward += r + [s.reward for s in rep]
      is_replay += [False] * len(group) + [True] * len(rep)
      engine_lp += [c.raw_logprobs for c in group] + [None] * len(rep)
    reward = np.asarray(rows_reward, np.float32)  # [P * G]
    is_replay = np.asarray(is_replay)
    flat_items = [it for it in items for _ in range(g)]
    batch = pack_sequences([list(it.token_ids) for it in flat_items],
                           [t.tolist() for t in rows_resp], pad_id=self.pad_id,
                           pad_to=self.pad_to)
    batch["response_mask"] = batch["response_mask"].astype(np.float32)
    batch["prompt_mask"] = batch["prompt_mask"].astype(np.float32)
    zeros = np.zeros(batch["input_ids"].shape, np.float32)
    batch["ref_logp"] = self._score_batched(self.ref_params, batch) if self._use_ref else zeros
    if self._old_in_update:
      batch["old_logp"] = zeros  # taken from the update's own forward pass (pi_old = pi_theta)
    elif rc.old_logp_source == "recompute" or is_replay.any():
      # Replayed rows have no rollout-time log-probs of the policy: recompute for all rows.
      batch["old_logp"] = self._score_batched(self.state.params, batch)
    else:
      old = np.zeros(batch["input_ids"].shape, np.float32)
      for i, (it, lp) in enumerate(zip(flat_items, engine_lp)):
        start = len(it.token_ids)
        old[i, start:start + len(lp)] = lp
      batch["old_logp"] = old
    grouped = reward.reshape(len(items), g)  # [P * G] -> [P, G]
    lc = cfg.loss
    batch["reward"] = np.asarray(lc.reward_transform.apply(grouped)).reshape(-1)  # [P, G] -> [B]
    batch["advantage"] = np.asarray(losses.group_zscore_advantages(grouped)).reshape(-1)
    if lc.method == "disa":
      batch["log_z"] = np.repeat(self._anchor_log_z(items), g)  # [P] -> [P * G]
    else:
      batch["log_z"] = np.zeros(len(rows_resp), np.float32)
    on = ~is_replay
    lengths = np.array([len(t) for t, r in zip(rows_resp, is_replay) if not r])
    sampled_lp = np.concatenate([c.logprobs for c in on_comps])
    stats = {  # over the on-policy rows
        "reward": float(reward[on].mean()),
        "accuracy": float((reward[on] > 0.5).mean()),
        "response_length": float(lengths.mean()),
        "response_length_max": float(lengths.max()),
        "truncated_frac": float(np.mean([c.finish_reason == "length" for c in on_comps])),
        # Monte-Carlo entropy estimate of the sampling distribution: -E[log p(sampled token)].
        "entropy": float(-sampled_lp.mean()),
        "reward_std_in_group": float(grouped.std(-1).mean()),
        "time/generate_s": t_gen,
        "tokens_generated": float(lengths.sum()),
    }
    if self.replay is not None:
      stats.update(self._replay_stats(step, batch, reward, is_replay, replayed))
    return batch, stats

  def _replay_stats(self, step, batch, reward, is_replay, replayed) -> dict[str, float]:
    out = {"replay/fraction": float(is_replay.mean()), "replay/prompt_coverage": float(
        np.mean([bool(r) for r in replayed]))}
    if not is_replay.any():
      return out
    stored = np.asarray([s.logp_ref for r in replayed for s in r])
    recomputed = (batch["ref_logp"] * batch["response_mask"]).sum(-1)[is_replay]  # [B, T] -> [R]
    drift = float(np.median(np.abs(recomputed - stored)))
    if not self._replay_checked and drift > self.cfg.replay.max_ref_logp_drift:
      raise ValueError(
          f"replay.path={self.cfg.replay.path!r}: median |stored log pi_ref - recomputed| = "
          f"{drift:.4g} nats at step {step} exceeds replay.max_ref_logp_drift="
          f"{self.cfg.replay.max_ref_logp_drift}: the Stage 1 file was scored under another "
          "reference model or prompt rendering")
    self._replay_checked = True
    out["replay/accuracy"] = float((reward[is_replay] > 0.5).mean())
    out["replay/ref_logp_drift"] = drift
    return out

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
      micro = ts.split_micro_batches(mini, rc.micro_batch_size)  # [M, ...] -> [K, b, ...]
      self.state, metrics = self.update(self.state, distributed.to_global(
          micro, self._micro_sharding, axis=1))
      collected.append({k: float(v) for k, v in distributed.replicate_to_hosts(metrics).items()})
    out = {}
    for k in collected[0]:
      vals = [c[k] for c in collected]
      out[k] = max(vals) if k.endswith("_max") else min(vals) if k.endswith("_min") else float(
          np.mean(vals))
    return out

  def _evaluate(self, done: int) -> dict[str, float]:
    ec = self.cfg.eval
    params = SamplingParams(n=ec.n, temperature=ec.temperature, top_p=ec.top_p,
                            max_tokens=ec.max_tokens, stop_token_ids=self.stop_token_ids,
                            seed=_derive_seed(self.cfg.seed, "eval", done))
    comps, rewards, _ = self._generate(self.eval_prompts, params)
    return _eval_metrics(rewards, [len(c.token_ids) for group in comps for c in group])

  def run(self) -> list[dict[str, float]]:
    """Trains from the current step to ``total_steps``; returns the metrics of the steps run."""
    cfg = self.cfg
    from tqdm.auto import tqdm  # pylint: disable=g-import-not-at-top
    bar = tqdm(total=cfg.total_steps, initial=self.start_step,
               disable=not cfg.progress_bar or not distributed.is_main_process(),
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
          metrics.update(self._evaluate(done))
        if self.logger is not None and (done % cfg.log_every == 0 or done == cfg.total_steps):
          self.logger.write(done, metrics)
        if done % cfg.checkpoint.every == 0 or done == cfg.total_steps:
          self.save(done)
        history.append(metrics)
        bar.update(1)
        bar.set_postfix(reward=f"{metrics['reward']:.3f}", loss=f"{metrics['loss']:.3g}")
    finally:
      bar.close()
      self.ckpt.wait_until_finished()
      if self.logger is not None:
        self.logger.flush()
    return history

  def close(self) -> None:
    self.ckpt.close()
    if self.logger is not None:
      self.logger.close()



def _prompt_embeddings(model: models.Transformer, ids: jax.Array, prompt_mask: jax.Array):
  from disa_jax import scoring  # pylint: disable=g-import-not-at-top
  return scoring.prompt_embeddings(model, ids, jnp.asarray(prompt_mask, jnp.int32))
