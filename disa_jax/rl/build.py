"""Builds a Stage 3 `Trainer` from its config: one small factory per part, one builder for callers.

Each part of a step is built from its own config section (or the few fields it reads) and handed
to `Trainer` as `StepParts`:

- `make_collector`: `RolloutCollector` from ``rollout``, ``replay``, ``validation`` and ``seed``;
- `make_scorer`: `BatchScorer` from the objective, ``rollout`` and ``replay.max_ref_logp_drift``;
- `make_objective_step`: `ObjectiveStep` from the objective;
- `make_updater`: `PolicyUpdater` from the objective, ``optim``, ``rollout``, ``seed`` and the
  run's update count;
- `make_weight_sync`: `WeightSync` (and, with ``rollout.max_staleness`` > 0, the
  `RolloutPipeline` it pushes through).

`validate_anchor` is the one place the anchor is checked against the objective (present exactly
when the objective needs one; fitted with its beta, reward transform, scale, width and, where the
caller knows them, reference model and prompt rendering). `build_trainer` is what every caller
(the Stage 3 workflow, tests, benchmarks) uses.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Mapping, Sequence

import jax

from disa_jax import models, parallel
from disa_jax.parallel import distributed
from disa_jax.rewards.graded import RewardFn
from disa_jax.rl.async_rollout import RolloutPipeline
from disa_jax.rl.collect import RolloutCollector
from disa_jax.rl.config import TrainConfig
from disa_jax.rl.objective_step import ObjectiveStep
from disa_jax.rl.objectives import Objective
from disa_jax.rl.prompts import PromptItem, PromptStream
from disa_jax.rl.replay import ReplayPool
from disa_jax.rl.scorer import BatchScorer
from disa_jax.rl.sync import WeightSync
from disa_jax.rl.trainer import StepParts, Trainer
from disa_jax.rl.update import PolicyUpdater, total_updates
from disa_jax.rollout import flat_weights
from disa_jax.rollout.types import Engine

_LOG = logging.getLogger("disa_jax.rl")


def validate_anchor(objective: Objective, anchor: Any, *, hidden_size: int | None,
                    identity: Mapping[str, str] | None = None, source: str = "") -> None:
  """The one check of the anchor against the objective (see the module docstring).

  Args:
    objective: the run's objective.
    anchor: the frozen `disa_jax.anchor.Anchor` (or table anchor), or None.
    hidden_size: the reference model's hidden width (an anchor on prompt embeddings must match).
    identity: ``reference=`` / ``rendering=`` the anchor must have been fitted under (checked for
      an anchor on embeddings; a table anchor by prompt id records label facts only).
    source: where the anchor came from (e.g. ``data.anchor_path='...'``), prefixed to a mismatch.

  Raises:
    ValueError: naming the objective and the missing or extra anchor, or the first mismatching
      fact of `Anchor.check_compatible`.
  """
  if not objective.needs_anchor:
    if anchor is not None:
      raise ValueError(f"an anchor was given but objective {objective.name!r} does not use one")
    return
  if anchor is None:
    raise ValueError(f"objective {objective.name!r} needs the frozen anchor, got anchor=None")
  try:
    if anchor.needs_embeddings:
      objective.check_anchor(anchor, embedding_dim=hidden_size, **dict(identity or {}))
    else:  # a table by prompt id (e.g. the exact log Z): label facts only
      objective.check_anchor(anchor, embedding_dim=None)
  except ValueError as e:
    if not source:
      raise
    raise ValueError(f"{source}: {e}") from None


def old_logp_in_update(cfg: TrainConfig) -> bool:
  """Whether pi_old comes from the update's own forward: one on-policy update per batch, recomputed
  pi_old, and nothing reads it on the host first (a batch log Z, or TB's behaviour log-probs of
  stale rollouts)."""
  obj, rc = cfg.objective, cfg.rollout
  return (obj.needs_old_logp and rc.num_minibatches == 1 and rc.old_logp_source == "recompute"
          and not obj.needs_batch_log_z and not (rc.max_staleness and obj.behaviour_as_old_logp))


def make_collector(cfg: TrainConfig, *, engine: Engine | None, prompts: Sequence[PromptItem],
                   reward_fn: RewardFn, decode: Callable[[Sequence[int]], str],
                   stop_token_ids: tuple[int, ...], replay_pool: ReplayPool | None,
                   leaders: list[int]) -> RolloutCollector:
  """The `RolloutCollector` of ``cfg``'s ``rollout``, ``replay``, ``validation`` and ``seed``."""
  rc = cfg.rollout
  stream = PromptStream(prompts, rc.prompts_per_batch, seed=cfg.seed, shuffle=cfg.shuffle,
                        max_prompt_len=rc.max_prompt_len)
  return RolloutCollector(rc, cfg.replay, cfg.validation, seed=cfg.seed,
                          rows_per_prompt=cfg.rows_per_prompt, engine=engine, stream=stream,
                          reward_fn=reward_fn, decode=decode, stop_token_ids=stop_token_ids,
                          replay_pool=replay_pool, leaders=leaders)


def make_updater(cfg: TrainConfig, policy: models.Transformer, mesh: jax.sharding.Mesh, *,
                 pad_id: int, pad_to: int) -> PolicyUpdater:
  """The `PolicyUpdater` of ``cfg``'s objective, ``optim``, ``rollout`` and ``seed``."""
  return PolicyUpdater(cfg.objective, cfg.optim, cfg.rollout, policy, mesh, seed=cfg.seed,
                       total_updates=total_updates(cfg), old_in_update=old_logp_in_update(cfg),
                       pad_id=pad_id, pad_to=pad_to)


def make_scorer(cfg: TrainConfig, updater: PolicyUpdater, *,
                reference: models.Transformer | None, anchor: Any, mesh: jax.sharding.Mesh,
                pad_id: int, pad_to: int) -> BatchScorer:
  """The `BatchScorer` of ``cfg``'s objective, ``rollout`` and ``replay.max_ref_logp_drift``
  (``anchor``: already validated, `validate_anchor`)."""
  obj = cfg.objective
  return BatchScorer(obj, cfg.rollout, cfg.replay.max_ref_logp_drift,
                     policy_graphdef=updater.graphdef,
                     reference=reference if (obj.needs_reference or obj.needs_anchor) else None,
                     anchor=anchor, mesh=mesh, pad_id=pad_id, pad_to=pad_to,
                     old_in_update=old_logp_in_update(cfg))


def make_objective_step(cfg: TrainConfig) -> ObjectiveStep:
  """The `ObjectiveStep` of ``cfg.objective``."""
  return ObjectiveStep(cfg.objective)


def make_weight_sync(cfg: TrainConfig, updater: PolicyUpdater, collector: RolloutCollector,
                     engine: Engine | None, dtype: Any = None,
                     bucket_bytes: int = flat_weights.DEFAULT_BUCKET_BYTES) -> WeightSync:
  """The `WeightSync` of the run (pushes in ``dtype``, buckets of ``bucket_bytes``); with
  ``rollout.max_staleness`` > 0 it pushes through a new `RolloutPipeline` of ``collector``
  (``sync.pipeline``)."""
  k = cfg.rollout.max_staleness
  pipeline = RolloutPipeline(collector, engine, k) if k else None
  return WeightSync(updater, engine, dtype, pipeline, bucket_bytes)


def _place_models(cfg: TrainConfig, mesh: jax.sharding.Mesh, policy: models.Transformer,
                  reference: models.Transformer | None) -> None:
  """Shards the models on the training mesh (warning where the micro-batch rows round up)."""
  rc = cfg.rollout
  shards = parallel.batch_shards(mesh)
  if rc.micro_batch_rows % shards and distributed.is_main_process():
    _LOG.warning("rollout.micro_batch_rows=%d -> %d rows per micro-batch (a multiple of the "
                 "mesh's data x fsdp = %d batch shards)", rc.micro_batch_rows,
                 parallel.rows_for_mesh(rc.micro_batch_rows, shards), shards)
  parallel.shard_model(policy, mesh, parallel.TRAIN_RULES)
  if reference is not None:
    parallel.shard_model(reference, mesh, parallel.TRAIN_RULES)


def build_parts(cfg: TrainConfig, *, policy: models.Transformer,
                reference: models.Transformer | None, engine: Engine | None,
                prompts: Sequence[PromptItem], reward_fn: RewardFn,
                decode: Callable[[Sequence[int]], str], stop_token_ids: tuple[int, ...],
                pad_id: int, anchor: Any, mesh: jax.sharding.Mesh, pad_to: int = 64,
                replay_pool: ReplayPool | None = None, sync_dtype: Any = None,
                sync_bucket_bytes: int = flat_weights.DEFAULT_BUCKET_BYTES) -> StepParts:
  """The `StepParts` of ``cfg`` (``anchor`` already validated, `validate_anchor`)."""
  leaders = distributed.host_leaders()
  if engine is None and jax.process_index() in leaders:
    raise ValueError(f"process {jax.process_index()} leads its host's generation but engine=None")
  _place_models(cfg, mesh, policy, reference)
  collector = make_collector(cfg, engine=engine, prompts=prompts, reward_fn=reward_fn,
                             decode=decode, stop_token_ids=stop_token_ids,
                             replay_pool=replay_pool, leaders=leaders)
  updater = make_updater(cfg, policy, mesh, pad_id=pad_id, pad_to=pad_to)
  scorer = make_scorer(cfg, updater, reference=reference, anchor=anchor, mesh=mesh,
                       pad_id=pad_id, pad_to=pad_to)
  sync = make_weight_sync(cfg, updater, collector, engine, sync_dtype, sync_bucket_bytes)
  return StepParts(collector=collector, scorer=scorer, objective=make_objective_step(cfg),
                   updater=updater, sync=sync, pipeline=sync.pipeline)


def build_trainer(cfg: TrainConfig, workdir: str, *, policy: models.Transformer,
                  reference: models.Transformer | None, engine: Engine | None,
                  prompts: Sequence[PromptItem], reward_fn: RewardFn,
                  decode: Callable[[Sequence[int]], str], stop_token_ids: tuple[int, ...],
                  pad_id: int, anchor: Any = None, anchor_identity: Mapping[str, str] | None = None,
                  anchor_source: str = "", validation_prompts: Sequence[PromptItem] = (),
                  mesh: jax.sharding.Mesh | None = None, pad_to: int = 64,
                  replay_pool: ReplayPool | None = None, identity: Mapping[str, Any] | None = None,
                  sync_dtype: Any = None,
                  sync_bucket_bytes: int = flat_weights.DEFAULT_BUCKET_BYTES,
                  measures: Callable[[int], Mapping[str, float]] | None = None) -> Trainer:
  """A `Trainer` of ``cfg`` on its parts (resumed from ``workdir``'s latest checkpoint, if any).

  Args:
    cfg: the validated run config.
    workdir: run directory (metrics, TensorBoard, checkpoints).
    policy: the trained `Transformer` (initialised from pi_ref's weights; updated in place).
    reference: the frozen pi_ref `Transformer` (None if the objective needs neither it nor an
      anchor).
    engine: the rollout engine; it must start with the policy's weights. In a multi-process run,
      each host leader passes its host's engine and the other processes None.
    prompts: training prompts.
    reward_fn: the run's `RewardFn` (`disa_jax.rewards.get_reward_fn`).
    decode: response token ids -> text (special tokens skipped), for the reward function.
    stop_token_ids: tokens that end a response (EOS).
    pad_id: padding token id.
    anchor: the frozen `disa_jax.anchor.Anchor` (objectives with ``needs_anchor``), unchecked:
      `validate_anchor` checks it here, once.
    anchor_identity: ``reference=`` / ``rendering=`` the anchor must have been fitted under.
    anchor_source: where the anchor came from, prefixed to a mismatch.
    validation_prompts: prompts for periodic validation (``cfg.validation``).
    mesh: device mesh (default: all devices on the fsdp axis).
    pad_to: without packing (``rollout.packing=False``), rows are padded to a multiple of this.
    replay_pool: Stage 1 samples for ``cfg.replay``.
    identity: what else a resumed checkpoint must agree on (model paths, data, anchor, ...).
    sync_dtype: dtype of the weights pushed to the engine (None: the parameters' own).
    sync_bucket_bytes: bucket size of that flat push (`WeightSync`).
    measures: called with the RL step every ``validation.every`` steps, after the weight sync;
      returns more validation metrics (e.g. the exact measures of `disa_jax.eval.exact`).
  """
  validate_anchor(cfg.objective, anchor,
                  hidden_size=reference.config.hidden_size if reference is not None else None,
                  identity=anchor_identity, source=anchor_source)
  mesh = mesh if mesh is not None else parallel.make_mesh()
  parts = build_parts(cfg, policy=policy, reference=reference, engine=engine, prompts=prompts,
                      reward_fn=reward_fn, decode=decode, stop_token_ids=stop_token_ids,
                      pad_id=pad_id, anchor=anchor, mesh=mesh, pad_to=pad_to,
                      replay_pool=replay_pool, sync_dtype=sync_dtype,
                      sync_bucket_bytes=sync_bucket_bytes)
  return Trainer(cfg, workdir, parts, validation_prompts=validation_prompts, identity=identity,
                 measures=measures)
