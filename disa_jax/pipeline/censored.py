"""Steps to a level as interval-censored data, and a comparison valid for it (issue 62, item 3).

A run's P(correct) is measured at some steps only, so the step where it first reaches a level is
known to lie in an interval (`time_to_level`):

- *interval*-censored, (the last measured step below the level, the first at or above it];
- *left*-censored, (0, first measured step], when the first measurement is already at or above
  the level and was taken after step 0 (the run got there before anyone looked);
- *exact* 0, when the measurement at step 0 (the initial policy) is already there;
- *right*-censored, (last measured step, inf), when it never gets there.

An interpolated step (`dynamics.matched_accuracy`) is a point inside the interval, for display;
a t-test over such points would treat a left-censored run's first measured step (all of them the
same number) as an observation with no variance.

`gehan_test` compares two sets of runs by Gehan's generalised Wilcoxon score for interval-censored
data, with its permutation distribution: a pair of runs scores +1 when the first's interval lies
entirely before the second's (it certainly got there first), -1 in the other order, 0 when the
intervals overlap (unknown order). The statistic U is the sum of the scores of the pairs across
the two sides; under "the two sides reach the level in the same distribution" every split of the
pooled runs into sides of the same sizes is equally likely, so the p-value is the share of splits
with |U| at least the observed (exactly over every split when there are at most ``max_exact``,
else over ``draws`` seeded random splits). U / (n_a n_b) is the effect: the share of cross pairs
where A's run certainly got there first minus the share where B's did.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Sequence

import numpy as np

KINDS = ("exact", "left", "interval", "right")


@dataclasses.dataclass(frozen=True)
class Interval:
  """When a run first reached a level: in (low, high] (``kind`` 'exact': at low = high).

  Attributes:
    low, high: the bounds in steps (high = inf: never reached by the last measurement, low).
    kind: 'exact' | 'left' | 'interval' | 'right' (the module docstring).
  """
  low: float
  high: float
  kind: str

  def __post_init__(self):
    if self.kind not in KINDS or not 0 <= self.low <= self.high:
      raise ValueError(f"an interval needs kind in {KINDS} and 0 <= low <= high, got {self}")

  def before(self, other: "Interval") -> bool:
    """Whether this run certainly reached the level before ``other`` did."""
    if self.kind == "exact" and other.kind == "exact":
      return self.low < other.low
    return self.high <= other.low and not (other.kind == "exact" and self.low >= other.low)


def time_to_level(steps: Sequence[float], p: Sequence[float], level: float) -> Interval:
  """`Interval` of the first step where ``p`` (``[M]`` P(correct) at ``steps``, increasing) is at
  or above ``level``."""
  steps, p = np.asarray(steps, np.float64), np.asarray(p, np.float64)
  if steps.ndim != 1 or steps.size < 1 or steps.shape != p.shape or np.any(np.diff(steps) <= 0):
    raise ValueError(f"time_to_level needs >= 1 measurement at increasing steps, one P(correct) "
                     f"each, got steps {steps.tolist()} and p {p.tolist()}")
  hit = np.flatnonzero(p >= level)
  if not hit.size:
    return Interval(low=float(steps[-1]), high=math.inf, kind="right")
  i = int(hit[0])
  if i > 0:
    return Interval(low=float(steps[i - 1]), high=float(steps[i]), kind="interval")
  if steps[0] == 0:
    return Interval(low=0.0, high=0.0, kind="exact")
  return Interval(low=0.0, high=float(steps[0]), kind="left")


def scores(runs: Sequence[Interval]) -> np.ndarray:
  """``[N, N]`` Gehan's pair scores: +1 where run i certainly got there before run j, -1 after,
  0 unknown (antisymmetric)."""
  n = len(runs)
  s = np.zeros((n, n))
  for i, j in itertools.combinations(range(n), 2):
    s[i, j] = 1.0 if runs[i].before(runs[j]) else (-1.0 if runs[j].before(runs[i]) else 0.0)
    s[j, i] = -s[i, j]
  return s


@dataclasses.dataclass(frozen=True)
class GehanTest:
  """`gehan_test`'s result.

  Attributes:
    u: Gehan's statistic (> 0: side A got there first more often).
    effect: u / (n_a n_b), in [-1, 1].
    p: the two-sided permutation p-value.
    splits: the splits it was computed over.
    exact: every split (True) or seeded random ones.
    sizes: runs per side (A, B).
    kinds: per side, how many runs of each censoring kind.
  """
  u: float
  effect: float
  p: float
  splits: int
  exact: bool
  sizes: tuple[int, int]
  kinds: tuple[dict[str, int], dict[str, int]]


def gehan_test(a: Sequence[Interval], b: Sequence[Interval], *, max_exact: int = 200_000,
               draws: int = 100_000, seed: int = 0) -> GehanTest:
  """Gehan's permutation test of "A's and B's runs reach the level in the same distribution".

  Args:
    a, b: each side's `Interval`s (>= 1 each).
    max_exact: enumerate every split when there are at most this many.
    draws: otherwise, this many random splits (seeded by ``seed``; the observed split counts).

  Returns:
    `GehanTest`.
  """
  na, nb = len(a), len(b)
  if na < 1 or nb < 1:
    raise ValueError(f"gehan_test needs >= 1 run a side, got {na} / {nb}")
  r = scores([*a, *b]).sum(1)  # U of a split = the sum of r over its side A (the scores cancel)
  u = float(r[:na].sum())
  n, total = na + nb, math.comb(na + nb, na)
  if total <= max_exact:
    sides = np.fromiter(itertools.chain.from_iterable(itertools.combinations(range(n), na)),
                        np.int64, count=total * na).reshape(total, na)
    sums = r[sides].sum(1)
    exact, count = True, total
  else:
    rng = np.random.default_rng(seed)
    picks = np.argsort(rng.random((draws, n)), axis=1)[:, :na]
    sums = np.concatenate([[u], r[picks].sum(1)])
    exact, count = False, draws + 1
  p = float(np.mean(np.abs(sums) >= abs(u) - 1e-9))
  kinds = lambda side: {k: sum(x.kind == k for x in side) for k in KINDS}
  return GehanTest(u=u, effect=u / (na * nb), p=p, splits=count, exact=exact, sizes=(na, nb),
                   kinds=(kinds(a), kinds(b)))
