"""A Stage 3 run's identity and resume: what its checkpoints record, and which one a rerun resumes
from after checking that it was written by the same run.

A checkpoint's meta records the train config (`config_lib.to_dict`), the run's identity entries
(model paths, data, anchor, ...), the policy's parameter shapes and the validation `Selection`.
A rerun resumes from the latest checkpoint in ``<workdir>/checkpoints`` once the config sections of
`RESUME_SECTIONS`, the identity and the parameter shapes agree, with an error that names the first
field that differs; a field the checkpoint does not record (written before the field existed)
counts as its default. ``total_steps`` may grow unless the learning rate decays
(``optim.decay_frac``): the decay phase starts at a share of the run's updates, so the schedule
would belong to neither run. When metrics.jsonl holds damaged rows at or before the latest
checkpoint, the run resumes from the latest checkpoint before them instead, deleting the newer
ones, so that the lost rows are computed again (`disa_jax.rl.metrics`); without such a checkpoint
it resumes from the latest and warns that those rows stay lost. With asynchronous rollouts the
batches already sampled by older weights are saved beside each checkpoint and restored with it.

`RunCheckpoints` does this for `disa_jax.rl.trainer.Trainer`; `train_identity` /
`recorded_train_identity` give the Stage 3 command (`disa_jax.workflows.stage3`) the part of the
run's identity file that the train config makes.
"""
from __future__ import annotations

import dataclasses
import os
import warnings
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from disa_jax import config as config_lib
from disa_jax import optim
from disa_jax.checkpoint import CheckpointManager, selection
from disa_jax.checkpoint.identity import flatten
from disa_jax.checkpoint.selection import Selection
from disa_jax.parallel import distributed
from disa_jax.rl import async_rollout
from disa_jax.rl.async_rollout import RolloutPipeline
from disa_jax.rl.config import TrainConfig
from disa_jax.rl.metrics import METRICS_FILE, scan_jsonl
from disa_jax.rl.objectives import Objective
from disa_jax.rl.update import PolicyUpdater

# Config sections a resumed run must share with the checkpoint (what a step computes and what
# validation selects on; total_steps may grow under a constant learning rate: `_check_schedule`).
RESUME_SECTIONS = ("objective", "optim", "rollout", "replay", "validation", "seed", "shuffle")

# What a Stage 3 run's identity holds of its train config (`disa_jax.workflows.stage3`): what a
# step computes, and total_steps (the learning-rate schedule, the end of the run).
IDENTITY_FIELDS = RESUME_SECTIONS + ("total_steps",)


def train_identity(train: Mapping[str, Any]) -> dict[str, Any]:
  """``{'train.<section>.<field>': value}`` of a train config's `IDENTITY_FIELDS` (``train``: as
  `config_lib.to_dict` spells a `TrainConfig`)."""
  return flatten("train", {k: train[k] for k in IDENTITY_FIELDS})


def recorded_train_identity(workdir: str | os.PathLike, objective: Objective) -> dict[str, Any]:
  """`train_identity` of the train config in the latest readable checkpoint of ``workdir`` ({}
  when there is none): what an identity file written before those fields existed lacks."""
  for step in reversed(selection.finished_steps(workdir)):
    try:
      meta = selection.read_meta(workdir, step)
    except (OSError, ValueError):  # a damaged checkpoint: the one before it
      continue
    return train_identity(saved_train_config(meta.get("config") or {}, objective))
  return {}


def saved_train_config(saved: Mapping[str, Any], objective: Objective) -> dict[str, Any]:
  """A checkpoint's train config (its meta's ``config``) as `config_lib.to_dict` spells it, a field
  it does not record (written before the field existed) taking its default (the objective's: those
  of ``objective``'s class when the checkpoint's section lacks them)."""
  defaults = {f.name: config_lib.to_dict(f.default) for f in dataclasses.fields(TrainConfig)
              if f.init}
  defaults["objective"] = config_lib.to_dict(type(objective)())
  return {name: ({**default, **(saved.get(name) or {})} if isinstance(default, dict)
                 else saved.get(name, default)) for name, default in defaults.items()}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Resumed:
  """Where a run starts: the checkpoint ``step`` it resumes from (None: a new run), the validation
  ``selection`` that checkpoint recorded (None: none recorded) and the in-flight rollout batches
  saved beside it."""
  step: int | None = None
  selection: Selection | None = None
  in_flight: Mapping[int, Any] = dataclasses.field(default_factory=dict)


class RunCheckpoints:
  """The checkpoints of one Stage 3 run in ``<workdir>/checkpoints`` (see the module docstring).

  Args:
    cfg: the run's validated train config.
    workdir: the run directory.
    updater: the trained state (saved and restored) and its push of weights to the engine.
    pipeline: the asynchronous rollouts (their in-flight batches kept beside each checkpoint);
      None: synchronous.
    identity: what else a resumed checkpoint must agree on (model paths, data, anchor, ...).
  """

  def __init__(self, cfg: TrainConfig, workdir: str, *, updater: PolicyUpdater,
               pipeline: RolloutPipeline | None, identity: Mapping[str, Any]):
    self.cfg, self.workdir, self.identity = cfg, workdir, dict(identity)
    self.updater, self.pipeline = updater, pipeline
    self.manager = CheckpointManager(f"{workdir}/checkpoints", max_to_keep=cfg.checkpoint.keep,
                                     async_save=cfg.checkpoint.async_save)
    self.saved_step: int | None = None  # the step of the last checkpoint written or restored

  def meta(self, step: int, chosen: Selection) -> dict[str, Any]:
    """What checkpoint ``step`` records beside the state (``chosen``: the validation selection)."""
    return {"rl_step": step, "data_position": step, "config": config_lib.to_dict(self.cfg),
            "identity": self.identity, "param_shapes": self.updater.param_shapes(),
            "selection": chosen.to_json()}

  def in_flight_path(self, step: int) -> str:
    return f"{self.workdir}/in_flight/{step}.npz"

  def save(self, step: int, chosen: Selection) -> None:
    """Checkpoints the state after ``step`` steps, keeping the best validated step of ``chosen``
    as well; with asynchronous rollouts, the batches already sampled by older weights beside it."""
    pipeline = self.pipeline
    if pipeline is not None:
      batches = pipeline.in_flight(step)
      if batches and distributed.is_main_process():
        async_rollout.save_batches(self.in_flight_path(step), batches)
    self.manager.save(step, self.updater.checkpoint_state(), self.meta(step, chosen), force=True,
                      keep_also=chosen.best_step)
    self.saved_step = step
    if pipeline is not None and distributed.is_main_process():
      kept = {str(s) for s in self.manager.all_steps()} | {str(step)}
      for f in Path(self.workdir, "in_flight").glob("*.npz"):
        if f.stem not in kept:
          f.unlink()

  def resume(self) -> Resumed:
    """Restores the checkpoint a rerun resumes from (checked first; then the newer ones it skips
    are deleted, with a warning); `Resumed()` when there is none."""
    latest = self.manager.latest_step()
    start = self._resume_point(latest)
    resumed = self._restore(start) if start is not None else Resumed()
    if start != latest:  # checked and restored first: only then are the newer ones deleted
      dropped = self.manager.discard_after(start)
      warnings.warn(f"{self.workdir}/{METRICS_FILE}: damaged rows of steps up to {latest}; "
                    f"resuming from checkpoint {start} to compute steps {start + 1}-{latest} "
                    f"again (checkpoints {dropped} deleted: they are written again)",
                    RuntimeWarning)
    return resumed

  def _resume_point(self, latest: int | None) -> int | None:
    """The checkpoint to resume from: ``latest``, or the latest before the first damaged row of
    metrics.jsonl when that row is not after ``latest``. Process 0 reads the file; every process
    resumes from its choice."""
    if latest is None:
      return None
    path = os.path.join(self.workdir, METRICS_FILE)
    lost = scan_jsonl(path).first_lost_step() if distributed.is_main_process() else None
    lost = int(distributed.process_allgather(np.asarray([-1 if lost is None else lost],
                                                        np.int32))[0, 0])  # process 0's
    if lost < 0 or lost > latest:  # nothing damaged, or only rows the resume recomputes anyway
      return latest
    earlier = [s for s in self.manager.intact_steps() if s < lost]
    if not earlier:
      warnings.warn(f"{path}: a damaged row holds a step from {lost} on, but no checkpoint before "
                    f"step {lost} is left (train.checkpoint.keep); resuming from step {latest}, "
                    "so the damaged rows stay lost (copied aside) and the rows after them are kept",
                    RuntimeWarning)
      return latest
    return earlier[-1]

  def check_resumable(self, step: int, saved: Mapping[str, Any]) -> None:
    """Names the first config field, identity entry or parameter shape of checkpoint ``step``
    (its meta: ``saved``) that differs from this run's.

    A field the checkpoint does not record (written before the field existed) counts as its
    default; an identity entry it records that this run does not (the input paths, compared by
    content in the stage's identity file since) is not compared.
    """
    now = {"config": config_lib.to_dict(self.cfg), "identity": self.identity,
           "param_shapes": self.updater.param_shapes()}
    recorded = saved_train_config(saved["config"], self.cfg.objective)
    where = f"cannot resume {self.workdir}: checkpoint {step} was written with"
    for section in RESUME_SECTIONS:
      old, new = recorded[section], now["config"][section]
      if isinstance(new, dict):
        for key in sorted(set(old) | set(new), key=lambda k: (k != "name", k)):  # name first
          if old.get(key) != new.get(key):
            raise ValueError(f"{where} {section}.{key}={old.get(key)!r}, this run has "
                             f"{new.get(key)!r}")
      elif old != new:
        raise ValueError(f"{where} {section}={old!r}, this run has {new!r}")
    self._check_schedule(where, recorded["total_steps"])
    for key in sorted(now["identity"]):
      if saved.get("identity", {}).get(key) != now["identity"].get(key):
        raise ValueError(f"{where} {key}={saved.get('identity', {}).get(key)!r}, this run has "
                         f"{now['identity'].get(key)!r}")
    old_shapes = saved.get("param_shapes", {})
    for name, shape in now["param_shapes"].items():
      if old_shapes.get(name) != shape:
        raise ValueError(f"{where} parameter {name} of shape {old_shapes.get(name)}, this run's "
                         f"model has {shape}")
    if saved["data_position"] != step:
      raise ValueError(f"checkpoint {step}: data_position {saved['data_position']} != step")

  def _check_schedule(self, where: str, saved_steps: int) -> None:
    """Refuses another ``total_steps`` when the learning rate's decay phase depends on it."""
    oc, updates = self.cfg.optim, self.cfg.rollout.num_minibatches
    old = optim.decay_boundary(oc.decay_frac, saved_steps * updates)
    new = optim.decay_boundary(oc.decay_frac, self.cfg.total_steps * updates)
    if old != new:
      raise ValueError(f"{where} total_steps={saved_steps}, this run has {self.cfg.total_steps}: "
                       f"with optim.decay_frac={oc.decay_frac} the learning rate's decay phase "
                       f"starts at optimizer update {old} there and {new} here, so the resumed "
                       "run would follow neither schedule; use its total_steps or a new workdir")

  def _restore(self, step: int) -> Resumed:
    """Checks checkpoint ``step`` against this run, restores the state from it and pushes the
    restored weights to the engine."""
    meta = self.manager.read_meta(step)
    self.check_resumable(step, meta)
    chosen = Selection.from_json(meta["selection"]) if meta.get("selection") else None
    _, restored, _ = self.manager.restore(self.updater.checkpoint_state(), step)
    self.updater.load_checkpoint_state(restored)
    self.saved_step = step
    in_flight = {}
    if self.pipeline is not None and step > 0:
      path = self.in_flight_path(step)
      if not os.path.exists(path):
        raise ValueError(f"cannot resume {self.workdir}: checkpoint {step} was written with "
                         f"rollout.max_staleness={self.cfg.rollout.max_staleness} but its in-flight "
                         f"rollouts {path} are missing")
      in_flight = async_rollout.load_batches(path)
    self.updater.push()
    return Resumed(step=step, selection=chosen, in_flight=in_flight)
