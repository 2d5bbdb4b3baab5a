"""Sync: the last part of a Stage 3 step. Pushes the updated policy weights to the rollout engine.

Synchronous rollouts (``rollout.max_staleness`` = 0) push at once (`PolicyUpdater.sync`, a
collective: a flat push, `disa_jax.rollout.multihost.push_weights`). Asynchronous ones (k > 0) hand
an owned host copy of the weights (the flat push's host buckets, `multihost.host_weights`) to the
`RolloutPipeline`, which queues the push on its rollout thread between the engine's generate calls
and then the sampling of step done + k (`disa_jax.rl.async_rollout`).
"""
from __future__ import annotations

from typing import Any

from disa_jax import config as config_lib
from disa_jax.rl.async_rollout import RolloutPipeline
from disa_jax.rl.update import PolicyUpdater
from disa_jax.rollout import flat_weights, multihost
from disa_jax.rollout.types import Engine


class WeightSync:
  """Pushes the policy to this host's engine (see the module docstring).

  Args:
    updater: the run's `PolicyUpdater` (it holds the trained weights).
    engine: this host's engine (None on processes that do not lead a host).
    dtype: dtype of the weights pushed (None: the parameters' own).
    pipeline: the asynchronous rollouts' pipeline (None: synchronous rollouts).
    bucket_bytes: the flat push's bucket size (`flat_weights.FlatLayout`; 0 = one bucket): the
      export's extra device memory is about two buckets. The same on every process.
  """

  def __init__(self, updater: PolicyUpdater, engine: Engine | None, dtype: Any = None,
               pipeline: RolloutPipeline | None = None,
               bucket_bytes: int = flat_weights.DEFAULT_BUCKET_BYTES):
    if pipeline is not None and pipeline.engine is not engine:
      raise ValueError("WeightSync: the rollout pipeline drives another engine than the one given")
    config_lib.check_count(bucket_bytes, "WeightSync bucket_bytes", "0 = one bucket")
    self.updater, self.engine, self.dtype, self.pipeline = updater, engine, dtype, pipeline
    self.bucket_bytes = bucket_bytes

  def push_now(self) -> None:
    """Collective: the engine gets the current weights before this returns (start, resume)."""
    self.updater.sync(self.engine, self.dtype, self.bucket_bytes)

  def after_update(self, done: int) -> None:
    """Collective: after ``done`` updates, the weights of version ``done`` go to the engine (at
    once, or queued before the pipeline's next sampling)."""
    if self.pipeline is None:
      self.push_now()
      return
    weights = multihost.host_weights(self.updater.current_policy(), self.dtype,
                                     self.bucket_bytes)  # collective
    self.pipeline.advance(done, weights if self.engine is not None else None)
