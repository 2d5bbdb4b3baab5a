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
that the checkpoint was written by the same run; what a checkpoint records, which one a rerun
resumes from and the checks are the run's identity and resume (`disa_jax.rl.run_state`,
`RunCheckpoints`). Multi-host runs execute this same loop on every process (see
`disa_jax.rl.collect` and `disa_jax.parallel.distributed`).
"""
from __future__ import annotations

import dataclasses
import os
import threading
import time
from typing import Any, Callable, Mapping, Sequence

from tqdm.auto import tqdm

from disa_jax import config as config_lib
from disa_jax import preemption
from disa_jax.checkpoint.selection import Selection
from disa_jax.parallel import distributed
from disa_jax.rl.async_rollout import RolloutPipeline
from disa_jax.rl.collect import RolloutCollector, rollout_stats
from disa_jax.rl.config import TrainConfig
from disa_jax.rl.metrics import METRICS_FILE, MetricsLogger, StepWindow
from disa_jax.rl.prompts import PromptItem
from disa_jax.rl.run_state import RunCheckpoints
from disa_jax.rl.scorer import BatchScorer, replay_stats
from disa_jax.rl.update import PolicyUpdater

# Per thread, a callable given each `Trainer` the thread builds, once built (unset: none):
# `disa_jax.rl.seed_batch` routes a seed's device calls through its thread's batch of seeds.
BUILD_HOOK = threading.local()


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
    self.checkpoints = RunCheckpoints(cfg, workdir, updater=parts.updater,
                                      pipeline=parts.pipeline, identity=self.identity)
    self.ckpt = self.checkpoints.manager
    self.preempted_at: int | None = None  # the step a preemption signal stopped the run at
    resumed = self.checkpoints.resume()
    self.start_step, self._restored_in_flight = resumed.step or 0, dict(resumed.in_flight)
    self.selection = resumed.selection or Selection(metric=f"eval/mean@{cfg.validation.n}")
    self.logger = (MetricsLogger(workdir, resume_step=resumed.step, tensorboard=cfg.tensorboard,
                                 wandb=cfg.wandb,
                                 run_config={"train": config_lib.to_dict(cfg),
                                             "identity": dict(self.identity)})
                   if distributed.is_main_process() else None)
    hook = getattr(BUILD_HOOK, "fn", None)
    if hook is not None:
      hook(self)

  # -- checkpoints (`disa_jax.rl.run_state`) -----------------------------------------------------

  def save(self, step: int) -> None:
    """Checkpoints the state after ``step`` steps (`RunCheckpoints.save`)."""
    self.checkpoints.save(step, self.selection)

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
            if self.checkpoints.saved_step != step and step > 0:
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
