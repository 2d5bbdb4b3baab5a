"""Builds a Stage 3 `Trainer` from its config and its inputs (`disa_jax.rl.inputs`).

Each part of a step takes the run's `TrainConfig` and the input groups it reads, and is handed to
`Trainer` as `StepParts`:

- `RolloutCollector` (the ``rollout``, ``replay``, ``validation`` sections, ``seed``; the
  `RolloutTask`; this host's engine);
- `BatchScorer` (the objective and what it needs, ``rollout``, ``replay.max_ref_logp_drift``; the
  `StepModels`' reference and mesh; the validated anchor);
- `PolicyUpdater` (the objective, ``optim``, ``rollout``, ``seed`` and the run's update count;
  the `StepModels`' policy and mesh; the `EngineLink` its weights are pushed through);
- with ``rollout.max_staleness`` > 0, the `RolloutPipeline` (the collector and this host's
  engine), which the updater's pushes are queued on.

`validate_anchor` is the one place the anchor is checked against the objective (present exactly
when the objective needs one; fitted with its beta, reward transform, scale, width and, where the
caller knows them, reference model and prompt rendering). `build_trainer` is what every caller
(the Stage 3 workflow, tests, benchmarks) uses.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Mapping

import jax

from disa_jax import parallel
from disa_jax.parallel import distributed
from disa_jax.rl.async_rollout import RolloutPipeline
from disa_jax.rl.collect import RolloutCollector
from disa_jax.rl.config import TrainConfig
from disa_jax.rl.inputs import AnchorInput, EngineLink, RolloutTask, StepModels
from disa_jax.rl.scorer import BatchScorer
from disa_jax.rl.trainer import StepParts, Trainer
from disa_jax.rl.update import PolicyUpdater

_LOG = logging.getLogger("disa_jax.rl")


def validate_anchor(cfg: TrainConfig, anchor: Any, *, hidden_size: int | None,
                    identity: Mapping[str, str] | None = None, source: str = "") -> None:
  """The one check of the anchor against the objective (see the module docstring).

  Args:
    cfg: the run's config (its objective, and whether it needs an anchor: ``cfg.needs``).
    anchor: the frozen `disa_jax.anchor.Anchor` (or table anchor), or None.
    hidden_size: the reference model's hidden width (an anchor on prompt embeddings must match).
    identity: ``reference=`` / ``rendering=`` the anchor must have been fitted under (checked for
      an anchor on embeddings; a table anchor by prompt id records label facts only).
    source: where the anchor came from (e.g. ``data.anchor_path='...'``), prefixed to a mismatch.

  Raises:
    ValueError: naming the objective and the missing or extra anchor, or the first mismatching
      fact of `Anchor.check_compatible`.
  """
  objective = cfg.objective
  if not cfg.needs.anchor:
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


def _place_models(cfg: TrainConfig, step_models: StepModels) -> None:
  """Shards the models on the training mesh (warning where the micro-batch rows round up)."""
  rc, mesh, reference = cfg.rollout, step_models.mesh, step_models.reference
  shards = parallel.batch_shards(mesh)
  if rc.micro_batch_rows % shards and distributed.is_main_process():
    _LOG.warning("rollout.micro_batch_rows=%d -> %d rows per micro-batch (a multiple of the "
                 "mesh's data x fsdp = %d batch shards)", rc.micro_batch_rows,
                 parallel.rows_for_mesh(rc.micro_batch_rows, shards), shards)
  parallel.shard_model(step_models.policy, mesh, parallel.TRAIN_RULES)
  if reference is not None:
    parallel.shard_model(reference, mesh, parallel.TRAIN_RULES)


def build_parts(cfg: TrainConfig, step_models: StepModels, task: RolloutTask, link: EngineLink,
                anchor: Any) -> StepParts:
  """The `StepParts` of ``cfg`` (``step_models.mesh`` set; ``anchor`` already validated,
  `validate_anchor`)."""
  leaders = distributed.host_leaders()
  if link.engine is None and jax.process_index() in leaders:
    raise ValueError(f"process {jax.process_index()} leads its host's generation but engine=None")
  _place_models(cfg, step_models)
  collector = RolloutCollector(cfg, task, link.engine, leaders)
  updater = PolicyUpdater(cfg, step_models, task.pad_id, link)
  scorer = BatchScorer(cfg, step_models, updater.graphdef, anchor, task.pad_id)
  k = cfg.rollout.max_staleness
  pipeline = RolloutPipeline(collector, link.engine, k) if k else None
  return StepParts(collector=collector, scorer=scorer, updater=updater, pipeline=pipeline)


def build_trainer(cfg: TrainConfig, workdir: str, step_models: StepModels, task: RolloutTask,
                  link: EngineLink, anchor: AnchorInput = AnchorInput(), *,
                  identity: Mapping[str, Any] | None = None,
                  measures: Callable[[int], Mapping[str, float]] | None = None) -> Trainer:
  """A `Trainer` of ``cfg`` on its parts (resumed from ``workdir``'s latest checkpoint, if any).

  Args:
    cfg: the validated run config.
    workdir: run directory (metrics, TensorBoard, checkpoints).
    step_models: the policy, pi_ref, the mesh (None: all devices on the fsdp axis) and ``pad_to``.
    task: the prompts, reward function, decoder, stop / pad ids and replay pool.
    link: this host's rollout engine and the weight push into it.
    anchor: the frozen anchor and the identity it must have been fitted under, checked here once
      (`validate_anchor`).
    identity: what else a resumed checkpoint must agree on (model paths, data, anchor, ...).
    measures: called with the RL step every ``validation.every`` steps, after the weight sync;
      returns more validation metrics (e.g. the exact measures of `disa_jax.eval.exact`).
  """
  reference = step_models.reference
  validate_anchor(cfg, anchor.anchor,
                  hidden_size=reference.config.hidden_size if reference is not None else None,
                  identity=anchor.identity, source=anchor.source)
  if step_models.mesh is None:
    step_models = dataclasses.replace(step_models, mesh=parallel.make_mesh())
  parts = build_parts(cfg, step_models, task, link, anchor.anchor)
  return Trainer(cfg, workdir, parts, validation_prompts=task.validation_prompts,
                 identity=identity, measures=measures)
