"""Objective: the third part of a Stage 3 step. Adds the objective's per-row signal.

`ObjectiveStep.apply(scored)` takes the scorer's `ScoredBatch` and returns a `SignalBatch`: the
objective's per-row signal (`Objective.batch_signal`: r~ for TB, the group advantage for GRPO/GSPO)
and the log Z the loss reads, the anchor's (scored) or, for an objective with
``needs_batch_log_z`` (VarGrad), the estimate from the batch's own samples.
"""
from __future__ import annotations

import dataclasses

from disa_jax.rl.batch import ScoredBatch, SignalBatch, require
from disa_jax.rl.objectives import Objective


@dataclasses.dataclass(frozen=True)
class ObjectiveStep:
  """The objective's part of a step (see the module docstring).

  Attributes:
    objective: the run's objective (``TrainConfig.objective``).
  """
  objective: Objective

  def __post_init__(self):
    if not isinstance(self.objective, Objective):
      raise TypeError(f"ObjectiveStep.objective must be an Objective, got "
                      f"{type(self.objective).__name__}")

  def apply(self, scored: ScoredBatch) -> SignalBatch:
    """The `SignalBatch` of ``scored``: ``signal`` ``[P, G] -> [B]`` and its log Z ``[B]``."""
    require(scored, ScoredBatch, "ObjectiveStep.apply")
    b = scored.rollout
    signal = self.objective.batch_signal(
        b.grouped_reward, b.is_replay.reshape(b.grouped_reward.shape)).reshape(-1)  # [P, G] -> [B]
    out = SignalBatch(scored=scored, signal=signal, log_z=scored.log_z)
    if self.objective.needs_batch_log_z:  # VarGrad: log Z from this batch's own samples
      out = dataclasses.replace(out, log_z=self.objective.batch_log_z(out))  # [B]
    return out
