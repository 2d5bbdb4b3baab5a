"""The one reward-function type: responses and their metadata in, `Graded` rewards out.

Every stage grades through a `RewardFn`:

    reward_fn(responses: Sequence[Response], metas: Sequence[Mapping]) -> Graded

- `Response`: the decoded text (special tokens skipped), the generated token ids (stop token
  included) and the finish reason, so a verifier can check the text (math, code) or the exact token
  sequence (a task whose correct set is enumerable, e.g. `disa_jax.tasks.sum`).
- `Graded`: ``reward`` ``[n]`` float32 and ``error`` ``[n]`` bool marking the items whose grading
  failed (the grader raised, ran out of time, or its process died). A failed grading is scored 0,
  like a wrong answer, but it is not one: a broken grader would look like a model that is always
  wrong. Stage 1 records the errors per sample, Stage 3 and evaluation report their share, and a
  grader that detects failures calls `warn_on_errors`, which makes a call whose share of failed
  items exceeds `ERROR_SHARE_WARN` loud (a `GraderErrorWarning` and a log line).
"""
from __future__ import annotations

import dataclasses
import logging
import warnings
from typing import Any, Callable, Mapping, Sequence

import numpy as np

__all__ = ["Response", "Graded", "RewardFn", "GraderErrorWarning", "ERROR_SHARE_WARN",
           "warn_on_errors"]

# A grading call whose share of failed items (exceptions and timeouts) exceeds this warns.
ERROR_SHARE_WARN = 0.05

_LOG = logging.getLogger("disa_jax.rewards")


class GraderErrorWarning(RuntimeWarning):
  """More than `ERROR_SHARE_WARN` of a grading call's items raised or timed out."""


@dataclasses.dataclass(frozen=True)
class Response:
  """One response to grade.

  Attributes:
    text: the decoded response (special tokens skipped).
    token_ids: the generated token ids, stop token included when it was emitted.
    finish_reason: 'stop' (a stop token ended it) or 'length' (the token limit did).
  """
  text: str
  token_ids: tuple[int, ...] = ()
  finish_reason: str = "stop"


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

  @classmethod
  def ok(cls, reward: Any) -> "Graded":
    """Rewards with no grading failure."""
    r = np.asarray(reward, np.float32)
    return cls(r, np.zeros(r.shape, bool))

  @property
  def num_errors(self) -> int:
    """Number of failed items."""
    return int(self.error.sum())

  @property
  def error_share(self) -> float:
    """Failed items / n (0.0 for n = 0)."""
    return float(self.error.mean()) if self.error.size else 0.0


RewardFn = Callable[[Sequence[Response], Sequence[Mapping[str, Any]]], Graded]


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
