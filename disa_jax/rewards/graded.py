"""The one reward-function type: responses and their metadata in, `Graded` rewards out.

Every stage grades through a `RewardFn`:

    reward_fn(responses: Sequence[Response], metas: Sequence[Mapping]) -> Graded

- `Response`: the decoded text (special tokens skipped), the generated token ids (stop token
  included) and the finish reason, so a verifier can check the text (math, code) or the exact token
  sequence (a task whose correct set is enumerable, e.g. `disa_jax.data.sum_task`).
- `Graded`: ``reward`` ``[n]`` float32 (finite) and ``error`` ``[n]`` bool marking the items whose
  grader raised or timed out. Those score 0 in ``reward`` but are counted apart, so a broken grader
  is not mistaken for a model that is always wrong: Stage 1 summaries and Stage 3 metrics report
  the error share, and a loud warning fires above ``ERROR_WARN_SHARE``.
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable, Mapping, Sequence

import numpy as np

ERROR_WARN_SHARE = 0.05


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
  """Rewards of n responses.

  Attributes:
    reward: ``[n]`` float32, finite; 0 where ``error``.
    error: ``[n]`` bool, True where grading raised or timed out.
  """
  reward: np.ndarray
  error: np.ndarray

  def __post_init__(self):
    r = np.asarray(self.reward, np.float32)
    e = np.asarray(self.error, bool)
    if r.ndim != 1 or e.shape != r.shape:
      raise ValueError(f"Graded.reward {r.shape} and error {e.shape} must be equal-length vectors")
    object.__setattr__(self, "reward", r)
    object.__setattr__(self, "error", e)

  @classmethod
  def ok(cls, reward: Any) -> "Graded":
    """Rewards with no grading error."""
    r = np.asarray(reward, np.float32)
    return cls(r, np.zeros(r.shape, bool))

  @property
  def error_share(self) -> float:
    return float(self.error.mean()) if self.error.size else 0.0

  @staticmethod
  def concat(parts: Sequence["Graded"]) -> "Graded":
    if not parts:
      return Graded.ok(np.zeros(0, np.float32))
    return Graded(np.concatenate([p.reward for p in parts]), np.concatenate([p.error for p in parts]))


RewardFn = Callable[[Sequence[Response], Sequence[Mapping[str, Any]]], Graded]


def warn_on_errors(graded: Graded, name: str) -> None:
  """A loud warning when more than ``ERROR_WARN_SHARE`` of a call's items failed to grade."""
  if graded.error_share > ERROR_WARN_SHARE:
    warnings.warn(f"reward {name!r}: {int(graded.error.sum())} of {graded.error.size} responses "
                  f"({graded.error_share:.0%}) could not be graded (grader exception or timeout); "
                  f"they score 0. Check the grader before trusting these rewards.",
                  RuntimeWarning, stacklevel=3)
