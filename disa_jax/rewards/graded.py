"""Rewards together with the items whose grading failed (the grader raised or ran out of time).

A failed grading is scored 0, like a wrong answer, but it is not one: a broken grader would look like
a model that is always wrong. `Graded(reward, error)` keeps both; `warn_on_errors` makes a call
whose share of failed items exceeds `ERROR_SHARE_WARN` loud (a `GraderErrorWarning` and a log line).
"""
from __future__ import annotations

import dataclasses
import logging
import warnings
from typing import Sequence

import numpy as np

__all__ = ["Graded", "GraderErrorWarning", "ERROR_SHARE_WARN", "warn_on_errors"]

# A grading call whose share of failed items (exceptions and timeouts) exceeds this warns.
ERROR_SHARE_WARN = 0.05

_LOG = logging.getLogger("disa_jax.rewards")


class GraderErrorWarning(RuntimeWarning):
  """More than `ERROR_SHARE_WARN` of a grading call's items raised or timed out."""


@dataclasses.dataclass(frozen=True)
class Graded:
  """Rewards and grading failures of n items.

  Attributes:
    reward: `[n]` float32; 0 where `error`.
    error: `[n]` bool; True where the grader raised, overran its time bound, or its process died.
  """

  reward: np.ndarray
  error: np.ndarray

  def __post_init__(self):
    reward = np.asarray(self.reward, np.float32)
    error = np.asarray(self.error, bool)
    if reward.ndim != 1 or error.shape != reward.shape:
      raise ValueError(f"Graded: reward and error must both be [n], got shapes {reward.shape} and "
                       f"{error.shape}")
    object.__setattr__(self, "reward", reward)
    object.__setattr__(self, "error", error)

  @property
  def num_errors(self) -> int:
    """Number of failed items."""
    return int(self.error.sum())

  @property
  def error_share(self) -> float:
    """Failed items / n (0.0 for n = 0)."""
    return float(self.error.mean()) if self.error.size else 0.0


def warn_on_errors(error: np.ndarray, *, what: str, examples: Sequence[str] = (),
                   threshold: float = ERROR_SHARE_WARN) -> bool:
  """Warns (and logs) when the share of failed items of one call exceeds ``threshold``.

  Args:
    error: `[n]` bool, the failed items of one call.
    what: names the grader in the message (e.g. 'math grading').
    examples: a few failure reasons to quote (the first 3 are shown).
    threshold: the share above which the call warns.

  Returns:
    Whether it warned.
  """
  error = np.asarray(error, bool)
  if not error.size:
    return False
  share = float(error.mean())
  if share <= threshold:
    return False
  shown = "; ".join(examples[:3])
  msg = (f"{what}: {int(error.sum())} of {error.size} items ({share:.1%}) raised or timed out "
         f"(more than {threshold:.0%}); they are scored 0 and counted as grader errors, not wrong "
         f"answers. Check the grader." + (f" First failures: {shown}" if shown else ""))
  warnings.warn(msg, GraderErrorWarning, stacklevel=3)
  _LOG.warning(msg)
  return True
