"""The Stage 3 loop (Alg. 1, lines 10-13): rollout -> score -> update -> weight push.

One RL step reads, part by part (each a small object of its own module, built from its own config
section by `disa_jax.rl.build` and handed to `Trainer` as `StepParts`; callers build a trainer
with `disa_jax.rl.build.build_trainer`):

1. rollout (`RolloutCollector`, `disa_jax.rl.collect`): the step's prompts, G samples each from the
   rollout engine, graded, into a frozen `RolloutBatch` (with ``rollout.max_staleness`` > 0,
   sampled ahead by the `RolloutPipeline`, `disa_jax.rl.async_rollout`);
2. score (`BatchScorer`, `disa_jax.rl.scorer`): the reference / old log-probs and the anchor's log Z
   the objective declares it needs, and its per-row signal (r~ or the group advantage), into a
   `ScoredBatch`;
3. update (`PolicyUpdater`, `disa_jax.rl.update`): ``num_minibatches`` optimizer updates, each
   over packed micro-batches (`disa_jax.data.packing`; the scorer's passes use the same rows);
   then the new policy weights to the engine (at once, or queued on the pipeline).

Then every ``validation.every`` steps (sparser before ``validation.dense_from`` with
``validation.early_every``: `ValidationConfig.due`; and before step 1 with ``validation.at_start``)
a validation pass, every ``checkpoint.every`` steps a checkpoint; a new best validation score
(Mean@n) is saved at once and kept beside the last ``checkpoint.keep`` checkpoints
(`disa_jax.checkpoint.selection`). SIGTERM / SIGUSR1 stop the loop at the next step boundary with
a checkpoint of the steps done (`disa_jax.preemption`); the rerun resumes exactly. Metrics go to
``<workdir>/metrics.jsonl`` and TensorBoard (process 0 only); a tqdm bar shows the ETA.

A run resumes from the latest checkpoint in ``<workdir>/checkpoints`` automatically, after checking
that the checkpoint was written by the same run (the config sections of `RESUME_SECTIONS`, model
identity, parameter shapes), with an error that names the first field that differs. ``total_steps``
may grow (the loop runs on to the new end) unless the learning rate decays (``optim.decay_frac``):
the decay phase starts at a share of the run's updates, so the schedule would belong to neither run
(the Stage 3 command refuses any change of it, `disa_jax.workflows.stage3`). When metrics.jsonl
holds damaged rows at or before the latest checkpoint, the run resumes from the latest checkpoint
before them instead, deleting the newer ones, so that the lost rows are computed again
(`disa_jax.rl.metrics`); without such a checkpoint it resumes from the latest and warns that those
rows stay lost. Multi-host runs execute this same loop on every process (see `disa_jax.rl.collect`
and `disa_jax.parallel.distributed`).
"""
from __future__ import annotations

import dataclasses
import os
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
from tqdm.auto import tqdm

from disa_jax import config as config_lib
from disa_jax import optim, preemption
from disa_jax.checkpoint import CheckpointManager, selection
from disa_jax.checkpoint.identity import flatten
from disa_jax.checkpoint.selection import Selection
from disa_jax.parallel import distributed
from disa_jax.rl import async_rollout
from disa_jax.rl.async_rollout import RolloutPipeline
from disa_jax.rl.collect import RolloutCollector, rollout_stats
from disa_jax.rl.config import TrainConfig
from disa_jax.rl.metrics import METRICS_FILE, MetricsLogger, StepWindow, scan_jsonl
from disa_jax.rl.objectives import Objective
from disa_jax.rl.prompts import PromptItem
from disa_jax.rl.scorer import BatchScorer, replay_stats
from disa_jax.rl.update import PolicyUpdater

# Config sections a resumed run must share with the checkpoint (what a step computes and what
# validation selects on; total_steps may grow under a constant learning rate: `_check_schedule`).
RESUME_SECTIONS = ("objective", "optim", "rollout", "replay", "validation", "seed", "shuffle")


# Per thread, a callable given each `Trainer` the thread builds, once built (unset: none):
# `disa_jax.rl.seed_batch` routes a seed's device calls through its thread's batch of seeds.
BUILD_HOOK = threading.local()


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


@dataclasses.dataclass(frozen=True)
class StepParts:
  """The parts of one RL step, each built from its own config section (`disa_jax.rl.build`).

  Attributes:
    collector: rollout: samples and grades a `RolloutBatch`.
    scorer: score: `RolloutBatch` -> `ScoredBatch`.
    updater: update: the trained state, its optimizer updates and the push of its weights to the
      engine.
    pipeline: the asynchronous rollouts (``rollout.max_staleness`` > 0); None: synchronous.
  """
  collector: RolloutCollector
  scorer: BatchScorer
  updater: PolicyUpdater
  pipeline: RolloutPipeline | None = None

  def __post_init__(self):
    if self.pipeline is not None and self.pipeline.engine is not self.updater.link.engine:
      raise ValueError("StepParts: the rollout pipeline drives another engine than the one the "
                       "updater pushes to")


class Trainer:
  """Runs a Stage 3 experiment (see the module docstring) on the parts it is given.

  Build one with `disa_jax.rl.build.build_trainer`. The constructor resumes from the latest
  checkpoint in ``<workdir>/checkpoints``, if any.

  Args:
    cfg: the validated run config (the loop's own settings: steps, validation, checkpoints, the
      resume check).
    workdir: run directory (metrics, TensorBoard, checkpoints).
    parts: the step's parts (`StepParts`).
    validation_prompts: prompts for periodic validation (``cfg.validation``).
    identity: what else a resumed checkpoint must agree on (model paths, data, anchor, ...).
    measures: called with the RL step every ``validation.every`` steps, after the weight sync;
      returns more validation metrics (e.g. the exact measures of `disa_jax.eval.exact`).
  """

  def __init__(self, cfg: TrainConfig, workdir: str, parts: StepParts, *,
               validation_prompts: Sequence[PromptItem] = (),
               identity: Mapping[str, Any] | None = None,
               measures: Callable[[int], Mapping[str, float]] | None = None):
    self.cfg, self.workdir, self.parts = cfg, workdir, parts
    self.identity, self.measures = dict(identity or {}), measures
    self.validation_prompts = list(validation_prompts)
    self.ckpt = CheckpointManager(f"{workdir}/checkpoints", max_to_keep=cfg.checkpoint.keep,
                                  async_save=cfg.checkpoint.async_save)
    self._restored_in_flight: dict[int, Any] = {}
    self.start_step = 0
    self.selection = Selection(metric=f"eval/mean@{cfg.validation.n}")
    self.preempted_at: int | None = None  # the step a preemption signal stopped the run at
    self._saved_step: int | None = None
    latest = self.ckpt.latest_step()
    start = self._resume_point(latest)
    if start is not None:
      self._resume(start)
    if start != latest:  # checked and restored first: only then are the newer ones deleted
      dropped = self.ckpt.discard_after(start)
      warnings.warn(f"{workdir}/{METRICS_FILE}: damaged rows of steps up to {latest}; resuming "
                    f"from checkpoint {start} to compute steps {start + 1}-{latest} again "
                    f"(checkpoints {dropped} deleted: they are written again)", RuntimeWarning)
    self.logger = (MetricsLogger(workdir, resume_step=start, tensorboard=cfg.tensorboard,
                                 wandb=cfg.wandb,
                                 run_config={"train": config_lib.to_dict(cfg),
                                             "identity": dict(self.identity)})
                   if distributed.is_main_process() else None)
    hook = getattr(BUILD_HOOK, "fn", None)
    if hook is not None:
      hook(self)

  # -- checkpoints -------------------------------------------------------------------------------

  def _meta(self, step: int) -> dict[str, Any]:
    return {"rl_step": step, "data_position": step, "config": config_lib.to_dict(self.cfg),
            "identity": self.identity, "param_shapes": self.parts.updater.param_shapes(),
            "selection": self.selection.to_json()}

  def _in_flight_path(self, step: int) -> str:
    return f"{self.workdir}/in_flight/{step}.npz"

  def save(self, step: int) -> None:
    """Checkpoints the state after ``step`` steps, keeping the best validated step as well; with
    asynchronous rollouts, the batches already sampled by older weights beside it."""
    pipeline = self.parts.pipeline
    if pipeline is not None:
      batches = pipeline.in_flight(step)
      if batches and distributed.is_main_process():
        async_rollout.save_batches(self._in_flight_path(step), batches)
    self.ckpt.save(step, self.parts.updater.checkpoint_state(), self._meta(step), force=True,
                   keep_also=self.selection.best_step)
    self._saved_step = step
    if pipeline is not None and distributed.is_main_process():
      kept = {str(s) for s in self.ckpt.all_steps()} | {str(step)}
      for f in Path(self.workdir, "in_flight").glob("*.npz"):
        if f.stem not in kept:
          f.unlink()

  def _resume_point(self, latest: int | None) -> int | None:
    """The checkpoint to resume from: ``latest``, or the latest before the first damaged row of
    metrics.jsonl when that row is not after ``latest`` (see the module docstring). Process 0
    reads the file; every process resumes from its choice."""
    if latest is None:
      return None
    path = os.path.join(self.workdir, METRICS_FILE)
    lost = scan_jsonl(path).first_lost_step() if distributed.is_main_process() else None
    lost = int(distributed.process_allgather(np.asarray([-1 if lost is None else lost],
                                                        np.int32))[0, 0])  # process 0's
    if lost < 0 or lost > latest:  # nothing damaged, or only rows the resume recomputes anyway
      return latest
    earlier = [s for s in self.ckpt.intact_steps() if s < lost]
    if not earlier:
      warnings.warn(f"{path}: a damaged row holds a step from {lost} on, but no checkpoint before "
                    f"step {lost} is left (train.checkpoint.keep); resuming from step {latest}, "
                    "so the damaged rows stay lost (copied aside) and the rows after them are kept",
                    RuntimeWarning)
      return latest
    return earlier[-1]

  def _check_resumable(self, step: int, saved: Mapping[str, Any]) -> None:
    """Names the first config field, identity entry or parameter shape that differs.

    A field the checkpoint does not record (written before the field existed) counts as its
    default; an identity entry it records that this run does not (the input paths, compared by
    content in the stage's identity file since) is not compared.
    """
    now = self._meta(step)
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

  def _resume(self, step: int) -> None:
    meta = self.ckpt.read_meta(step)
    self._check_resumable(step, meta)
    if meta.get("selection"):
      self.selection = Selection.from_json(meta["selection"])
    updater = self.parts.updater
    _, restored, _ = self.ckpt.restore(updater.checkpoint_state(), step)
    updater.load_checkpoint_state(restored)
    self.start_step = self._saved_step = step
    if self.parts.pipeline is not None and step > 0:
      path = self._in_flight_path(step)
      if not os.path.exists(path):
        raise ValueError(f"cannot resume {self.workdir}: checkpoint {step} was written with "
                         f"rollout.max_staleness={self.cfg.rollout.max_staleness} but its in-flight "
                         f"rollouts {path} are missing")
      self._restored_in_flight = async_rollout.load_batches(path)
    updater.push()

  # -- one RL step -------------------------------------------------------------------------------

  def step(self, step: int) -> dict[str, float]:
    """RL step ``step`` (0-based): rollout -> score -> update -> weight push."""
    parts = self.parts
    updater, pipeline = parts.updater, parts.pipeline
    t0 = time.perf_counter()
    batch = (pipeline.take(step) if pipeline is not None
             else parts.collector.collect(step, version=step))
    t_pack = time.perf_counter()
    packed = updater.pack(step, batch)  # the step's one packed layout: scored, then trained on
    pack_s = time.perf_counter() - t_pack
    scored = parts.scorer.score(packed, updater.state.params)
    t1 = time.perf_counter()
    metrics = rollout_stats(batch)
    if self.cfg.replay.enabled:
      metrics.update(replay_stats(scored))
    metrics.update(updater.update(scored))
    t2 = time.perf_counter()
    if pipeline is None:
      updater.push()
    else:  # queued before the pipeline's sampling of step step + 1 + k
      updater.queue_push(pipeline, step + 1)
    t3 = time.perf_counter()
    metrics["rollout/staleness"] = float(step - batch.policy_version)
    # rollout = sampling, grading and scoring; the step's packing is its own phase
    metrics.update({"time/rollout_s": t1 - t0 - pack_s, "time/pack_s": pack_s,
                    "time/train_s": t2 - t1, "time/sync_s": t3 - t2, "time/step_s": t3 - t0,
                    "tokens_per_s": batch.num_tokens / max(t3 - t0, 1e-9)})
    return metrics

  def validate(self, done: int, metrics: dict[str, float]) -> bool:
    """Validates the current weights after ``done`` steps into ``metrics``; True at a new best."""
    if self.parts.pipeline is not None:  # the engine is free, holding the weights after ``done``
      self.parts.pipeline.wait_idle()
    if self.validation_prompts:
      metrics.update(self.parts.collector.validate(self.validation_prompts, done))
    if self.measures is not None:
      metrics.update(self.measures(done))
    if not self.validation_prompts:
      return False
    self.selection = self.selection.add(done, metrics[self.selection.metric])
    return self.selection.best_step == done

  def _validate_at_start(self) -> None:
    """Step 0's validation (the initial policy); checkpoint 0 when it is a selection candidate."""
    metrics: dict[str, float] = {}
    if self.validate(0, metrics):
      self.save(0)
    if self.logger is not None:
      self.logger.write(0, metrics)

  def run(self) -> list[dict[str, float]]:
    """Trains from the current step to ``total_steps``; returns the metrics of the steps run.

    Stops early, with a checkpoint of the steps done and ``preempted_at`` set, when a preemption
    signal arrives (`disa_jax.preemption`).
    """
    cfg, vc = self.cfg, self.cfg.validation
    bar = tqdm(total=cfg.total_steps, initial=self.start_step,
               disable=not cfg.progress_bar or not distributed.is_main_process(),
               desc=f"stage3/{cfg.objective.name}", unit="step")
    history, pipeline = [], self.parts.pipeline
    window = StepWindow.resumed(os.path.join(self.workdir, METRICS_FILE), self.start_step, vc.due)
    if pipeline is not None:
      pipeline.start(self.start_step, self._restored_in_flight)
    try:
      with preemption.watch():
        for step in range(self.start_step, cfg.total_steps):
          if (step == 0 and vc.at_start and (self.validation_prompts or self.measures is not None)
              and 0 not in dict(self.selection.scores)):  # not again after a resume from 0
            self._validate_at_start()
          if preemption.agreed(distributed.any_process):
            if self._saved_step != step and step > 0:
              self.save(step)
            self.preempted_at = step
            break
          metrics = self.step(step)
          done = step + 1
          window.add(metrics)
          if vc.due(done):  # a measurement: what the steps since the previous one did
            metrics.update(window.close())
          best = bool(vc.due(done) and self.validate(done, metrics))
          if self.logger is not None and (done % cfg.log_every == 0 or done == cfg.total_steps):
            self.logger.write(done, metrics)
          if done % cfg.checkpoint.every == 0 or done == cfg.total_steps or best:
            self.save(done)
          history.append(metrics)
          bar.update(1)
          bar.set_postfix(reward=f"{metrics['reward']:.3f}", loss=f"{metrics['loss']:.3g}")
    except BaseException:
      if pipeline is not None:  # no rollout thread left waiting on the engine
        pipeline.close()
      raise
    finally:
      bar.close()
      self.ckpt.wait_until_finished()
      if self.logger is not None:
        self.logger.flush()
    return history

  def close(self) -> None:
    if self.parts.pipeline is not None:
      self.parts.pipeline.close()
    self.ckpt.close()
    if self.logger is not None:
      self.logger.close()
