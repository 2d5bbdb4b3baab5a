"""Supervised learning on replayed samples (`disa_jax.rl.objectives`): the control of the replay
fix."""
from __future__ import annotations

import dataclasses
from typing import ClassVar

import numpy as np

from disa_jax.rl import losses
from disa_jax.rl.objectives.base import Objective, register


@register
@dataclasses.dataclass(frozen=True, kw_only=True)
class ReplaySft(Objective):
  """Supervised learning on the replayed Stage 1 samples: the negative log-likelihood of each
  replayed row that the verifier accepted, on-policy rows weighted 0 (`disa_jax.rl.losses.sft_loss`).

  With the replay of `disa_pos_replay` (reward-1, deduplicated, k rows per prompt and step) it
  trains on the same samples for the same steps as the fix, so the two differ only in the loss: TB
  against a frozen log Z versus maximum likelihood. It needs replay (``train.replay.fraction`` > 0).
  The loss is the mean over all valid rows (on-policy rows count 0), so a step's gradient is that of
  the replayed rows' mean NLL times their share of the rows, k / (G + k).
  """
  name: ClassVar[str] = "replay_sft"
  allows_replay: ClassVar[bool] = True

  def check_replay(self, fraction: float) -> None:
    if not fraction > 0:
      raise ValueError(f"objective {self.name!r} learns from replayed rows only: it needs "
                       f"replay.fraction > 0, got {fraction}")

  def row_signal(self, reward: np.ndarray) -> np.ndarray:
    """1 for the rows the verifier accepted (raw reward > 0.5), 0 otherwise."""
    return np.asarray(np.asarray(reward) > 0.5, np.float32)

  def batch_signal(self, reward: np.ndarray, is_replay: np.ndarray) -> np.ndarray:
    """`row_signal` on the replayed rows, 0 on the on-policy ones."""
    return self.row_signal(reward) * np.asarray(is_replay, np.float32)

  def loss(self, logp, batch, state_out=None):
    return losses.sft_loss(logp, batch.signal, batch.response_mask)
