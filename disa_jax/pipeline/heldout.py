"""Held-out prompts of the sum task: Stage 3 trains on a seeded share of the n values and the
evaluation also reports the others, so that the diversity a method keeps can be checked beyond its
training prompts (issue 27)."""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np


@dataclasses.dataclass(frozen=True, kw_only=True)
class HeldoutConfig:
  """``fraction`` of the n values held out of Stage 3 (0 = none), drawn with ``seed``; with
  ``anchor`` also out of Stage 2's fit (`Stage2Config.exclude_prompts_path`), so that the anchor's
  error on them measures how it generalises to prompts it never saw (issue 45)."""
  fraction: float = 0.0
  seed: int = 0
  anchor: bool = False

  def __post_init__(self):
    if not 0.0 <= self.fraction < 1.0:
      raise ValueError(f"heldout.fraction must be in [0, 1), got {self.fraction!r}")

  @property
  def enabled(self) -> bool:
    return self.fraction > 0


def split_values(values: Sequence[int], fraction: float, seed: int
                 ) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """(train, held out): round(fraction * len) values held out (at least 1, at most len - 1), drawn
  by a permutation seeded with ``seed``; both parts sorted.

  Args:
    values: distinct values (the task's n values).
    fraction: in (0, 1).
    seed: the split's seed (the same seed gives the same split).
  """
  values = [int(v) for v in values]
  if len(set(values)) != len(values) or len(values) < 2:
    raise ValueError(f"split_values needs >= 2 distinct values, got {values!r}")
  if not 0.0 < fraction < 1.0:
    raise ValueError(f"heldout fraction must be in (0, 1), got {fraction!r}")
  k = min(max(int(round(fraction * len(values))), 1), len(values) - 1)
  order = np.random.default_rng([int(seed), 27]).permutation(len(values))
  held = sorted(values[i] for i in order[:k])
  return tuple(sorted(set(values) - set(held))), tuple(held)
