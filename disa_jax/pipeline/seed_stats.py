"""Seed-level statistics of the report: Welch's t-test of "A below B" over Stage 3 seeds.

A comparison of two methods is decided on their seed-level end-state values (one number per seed,
e.g. each seed's final KL(pi || pi~)), never on one run's Monte Carlo standard error: seeds differ
by more than the sampling noise of one evaluation. Each seed's value also carries that Monte Carlo
error; the spread across seeds already contains it in expectation, so the variance of a method's
mean is max(s^2, mean(se_i^2)) / n (s^2: the sample variance over its n seeds): a small-sample
s^2 below the known measurement noise is not believed. Welch's t then uses those variances with the
Welch-Satterthwaite degrees of freedom (Welch 1947); without standard errors it is exactly
``scipy.stats.ttest_ind(a, b, equal_var=False)``.

The Student-t distribution is evaluated through the regularised incomplete beta function
(`betainc`, a continued fraction in float64), so the runtime needs no scipy.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

_EPS, _TINY, _MAX_ITER = 1e-15, 1e-300, 400


def _beta_fraction(a: float, b: float, x: float) -> float:
  """The continued fraction of I_x(a, b) (modified Lentz; converges for x < (a + 1) / (a + b + 2))."""
  c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
  d = 1.0 / (d if abs(d) > _TINY else _TINY)
  h = d
  for m in range(1, _MAX_ITER + 1):
    for num in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
      d = 1.0 + num * d
      d = 1.0 / (d if abs(d) > _TINY else _TINY)
      c = 1.0 + num / c
      c = c if abs(c) > _TINY else _TINY
      h *= d * c
    if abs(d * c - 1.0) < _EPS:
      return h
  raise ArithmeticError(f"betainc({a}, {b}, {x}) did not converge in {_MAX_ITER} terms")


def betainc(a: float, b: float, x: float) -> float:
  """The regularised incomplete beta function I_x(a, b), a, b > 0, x in [0, 1]."""
  if not (a > 0 and b > 0 and 0.0 <= x <= 1.0):
    raise ValueError(f"betainc needs a, b > 0 and x in [0, 1], got a={a}, b={b}, x={x}")
  if x in (0.0, 1.0):
    return x
  log_front = (math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x)
               + b * math.log1p(-x))
  if x < (a + 1.0) / (a + b + 2.0):
    return math.exp(log_front) * _beta_fraction(a, b, x) / a
  return 1.0 - math.exp(log_front) * _beta_fraction(b, a, 1.0 - x) / b


def t_two_sided_p(t: float, df: float) -> float:
  """P(|T| >= |t|) for Student's T with ``df`` > 0 degrees of freedom."""
  if not df > 0:
    raise ValueError(f"degrees of freedom must be > 0, got {df}")
  return betainc(df / 2.0, 0.5, df / (df + t * t))


def t_quantile(q: float, df: float) -> float:
  """The ``q`` quantile (q in (0.5, 1)) of Student's T with ``df`` degrees of freedom (bisection)."""
  if not 0.5 < q < 1.0:
    raise ValueError(f"t_quantile needs q in (0.5, 1), got {q}")
  lo, hi = 0.0, 1.0
  while t_two_sided_p(hi, df) / 2.0 > 1.0 - q:
    lo, hi = hi, 2.0 * hi
  for _ in range(200):
    mid = 0.5 * (lo + hi)
    lo, hi = (mid, hi) if t_two_sided_p(mid, df) / 2.0 > 1.0 - q else (lo, mid)
  return 0.5 * (lo + hi)


@dataclasses.dataclass(frozen=True)
class Comparison:
  """Welch's test of mean(a) - mean(b) over seeds (`welch`).

  Attributes:
    diff: mean(a) - mean(b).
    ci_low, ci_high: its two-sided ``level`` interval (Welch's t quantile x its standard error).
    se: the standard error of the difference.
    t, df: Welch's statistic and degrees of freedom.
    p: the two-sided p-value of diff = 0.
    n_a, n_b: seeds of each side.
    level: the interval's confidence level.
  """
  diff: float
  ci_low: float
  ci_high: float
  se: float
  t: float
  df: float
  p: float
  n_a: int
  n_b: int
  level: float

  def below(self, alpha: float = 0.05) -> bool:
    """"A below B": the difference is negative and p < alpha."""
    return self.diff < 0 and self.p < alpha


def _var_of_mean(x: np.ndarray, se: Sequence[float] | None, side: str) -> float:
  if x.size < 2:
    raise ValueError(f"welch needs >= 2 seeds on side {side}, got {x.size} ({x.tolist()})")
  if not np.all(np.isfinite(x)):
    raise ValueError(f"welch got non-finite values on side {side}: {x.tolist()}")
  var = float(x.var(ddof=1))
  if se is not None:
    se = np.asarray(se, np.float64)
    if se.shape != x.shape or not np.all(se >= 0):
      raise ValueError(f"welch side {side}: standard errors {se.tolist()} must be >= 0, one per "
                       f"value of {x.tolist()}")
    var = max(var, float(np.mean(se ** 2)))
  return var / x.size


def welch(a: Sequence[float], b: Sequence[float], *, a_se: Sequence[float] | None = None,
          b_se: Sequence[float] | None = None, level: float = 0.95) -> Comparison:
  """Welch's t-test of mean(a) - mean(b) from seed-level values (see the module docstring).

  Args:
    a, b: ``[n_a]`` / ``[n_b]`` one value per seed (n >= 2 each).
    a_se, b_se: the values' Monte Carlo standard errors (None: the spread alone).
    level: the confidence level of the interval.

  Returns:
    `Comparison`.
  """
  xa, xb = np.asarray(a, np.float64), np.asarray(b, np.float64)
  va, vb = _var_of_mean(xa, a_se, "a"), _var_of_mean(xb, b_se, "b")
  diff, se = float(xa.mean() - xb.mean()), math.sqrt(va + vb)
  if se == 0.0:
    raise ValueError(f"welch: both sides are constant ({xa.tolist()}, {xb.tolist()}) and carry no "
                     "standard errors: no test")
  df = (va + vb) ** 2 / (va ** 2 / (xa.size - 1) + vb ** 2 / (xb.size - 1))
  t = diff / se
  half = t_quantile(0.5 + level / 2.0, df) * se
  return Comparison(diff=diff, ci_low=diff - half, ci_high=diff + half, se=se, t=t, df=df,
                    p=t_two_sided_p(t, df), n_a=int(xa.size), n_b=int(xb.size), level=level)
