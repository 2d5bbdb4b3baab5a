"""Seed-level statistics of the report: Welch's t-test over Stage 3 seeds, its equivalence form,
Fisher's exact test of failure counts, a one-sample t-test and Holm's family-wise correction.

A comparison of two methods is decided on their seed-level end-state values (one number per seed,
e.g. each seed's final KL(pi || pi~)), never on one run's Monte Carlo standard error: seeds differ
by more than the sampling noise of one evaluation. Each seed's value also carries that Monte Carlo
error; the spread across seeds already contains it in expectation, so the variance of a method's
mean is max(s^2, mean(se_i^2)) / n (s^2: the sample variance over its n seeds): a small-sample
s^2 below the known measurement noise is not believed. Welch's t then uses those variances with the
Welch-Satterthwaite degrees of freedom (Welch 1947); without standard errors it is exactly
``scipy.stats.ttest_ind(a, b, equal_var=False)``. The values of different seeds must be
independent draws (`pipeline.seeds` gives every run and evaluation its own sampling seed).

- `Comparison.tost_p`: the equivalence test (two one-sided tests) of |diff| < margin: p < alpha
  exactly when the (1 - 2 alpha) interval of the difference lies inside (-margin, margin).
- `fisher_exact`: counts of runs that failed (collapsed or diverged) on two sides, where a mean
  over the failed runs' values would measure where each failure landed, not the method;
  `fisher_min_p`: the smallest p-value its margins allow (a test that cannot reject).
- `one_sample`: a mean difference of paired values (e.g. per prompt) against 0.
- `holm`: Holm's step-down adjusted p-values over a report's family of tests (the family-wise
  error rate is at most alpha when every verdict requires adjusted p < alpha).

The Student-t distribution is evaluated through the regularised incomplete beta function
(`betainc`, a continued fraction in float64), so the runtime needs no scipy (a test dependency
only: the tests check every function here against it).
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


def t_sf(t: float, df: float) -> float:
  """P(T >= t), one-sided, for Student's T with ``df`` > 0 degrees of freedom."""
  half = t_two_sided_p(t, df) / 2.0
  return half if t >= 0 else 1.0 - half


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

  def tost_p(self, margin: float) -> float:
    """The p-value of "|diff| < margin" by two one-sided t-tests (equivalence): the larger of
    P(T >= (diff + margin) / se) and P(T <= (diff - margin) / se) under a difference at the margin.
    It is < alpha exactly when the (1 - 2 alpha) interval of the difference lies inside
    (-margin, margin)."""
    if not margin > 0:
      raise ValueError(f"tost_p needs a margin > 0, got {margin!r}")
    return max(t_sf((self.diff + margin) / self.se, self.df),
               t_sf((margin - self.diff) / self.se, self.df))


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


_lgamma = np.vectorize(math.lgamma, otypes=[np.float64])


def _log_choose(n: np.ndarray | int, k: np.ndarray | int) -> np.ndarray:
  """log C(n, k), elementwise (0 <= k <= n)."""
  n, k = np.asarray(n, np.float64), np.asarray(k, np.float64)
  return _lgamma(n + 1.0) - _lgamma(k + 1.0) - _lgamma(n - k + 1.0)


def fisher_exact(a_events: int, a_n: int, b_events: int, b_n: int) -> float:
  """Two-sided p of Fisher's exact test of "side a and side b have the same event rate".

  With the margins fixed, a's count is hypergeometric; the p-value sums the probabilities of every
  table no more probable than the observed one (relative tolerance 1e-7 for ties), as
  ``scipy.stats.fisher_exact([[a_events, a_n - a_events], [b_events, b_n - b_events]])``.

  Args:
    a_events, a_n: runs with the event (e.g. collapsed) and runs in all on side a (0 <= events <= n).
    b_events, b_n: the same on side b.

  Returns:
    The p-value (1 when a row or column of the table is empty).
  """
  for side, k, n in (("a", a_events, a_n), ("b", b_events, b_n)):
    if not (isinstance(k, (int, np.integer)) and isinstance(n, (int, np.integer)) and 0 <= k <= n):
      raise ValueError(f"fisher_exact side {side}: needs 0 <= events <= n (ints), got events={k!r}, "
                       f"n={n!r}")
  events, total = a_events + b_events, a_n + b_n
  if min(a_n, b_n, events, total - events) == 0:
    return 1.0
  x = np.arange(max(0, events - b_n), min(a_n, events) + 1)
  # log P(a's count = x): a_n draws from the total, of which `events` have the event
  logp = _log_choose(events, x) + _log_choose(total - events, a_n - x) - _log_choose(total, a_n)
  observed = logp[x == a_events][0]
  return float(min(1.0, np.exp(logp[logp <= observed + 1e-7]).sum()))


def fisher_min_p(events: int, a_n: int, b_n: int) -> float:
  """The smallest two-sided `fisher_exact` p-value any table with these margins can give (``events``
  in all over sides of ``a_n`` and ``b_n`` runs): a test whose smallest p is >= alpha cannot
  reject, whatever the split (Tarone 1990), so it is left out of a corrected family."""
  if not (0 <= events <= a_n + b_n):
    raise ValueError(f"fisher_min_p needs 0 <= events <= a_n + b_n, got {events}, {a_n}, {b_n}")
  return min(fisher_exact(x, a_n, events - x, b_n)
             for x in range(max(0, events - b_n), min(a_n, events) + 1))


@dataclasses.dataclass(frozen=True)
class OneSample:
  """A one-sample t-test of mean(x) = 0 (`one_sample`): mean, standard error, degrees of freedom,
  two-sided p and the ``level`` interval of the mean."""
  mean: float
  se: float
  df: float
  p: float
  ci_low: float
  ci_high: float
  n: int


def one_sample(x: Sequence[float], *, level: float = 0.95) -> OneSample:
  """One-sample t-test of mean(x) = 0 over ``[n]`` independent values (e.g. paired differences
  per prompt; n >= 2, finite, not all equal), as ``scipy.stats.ttest_1samp(x, 0)``."""
  v = np.asarray(x, np.float64)
  if v.ndim != 1 or v.size < 2 or not np.all(np.isfinite(v)):
    raise ValueError(f"one_sample needs >= 2 finite values, got {v.tolist()}")
  se = float(v.std(ddof=1) / math.sqrt(v.size))
  if se == 0.0:
    raise ValueError(f"one_sample: the values are constant ({v[0]!r} x {v.size}): no test")
  mean, df = float(v.mean()), float(v.size - 1)
  half = t_quantile(0.5 + level / 2.0, df) * se
  return OneSample(mean=mean, se=se, df=df, p=t_two_sided_p(mean / se, df), ci_low=mean - half,
                   ci_high=mean + half, n=int(v.size))


def holm(p: Sequence[float]) -> np.ndarray:
  """Holm's step-down adjusted p-values of a family of m tests, in the input order.

  Sorted ascending, the i-th smallest (1-based) is adjusted to max over j <= i of
  min(1, (m - j + 1) p_(j)); rejecting every test whose adjusted p is < alpha keeps the
  probability of any false rejection in the family at most alpha (Holm 1979).

  Args:
    p: ``[m]`` raw p-values in [0, 1].

  Returns:
    ``[m]`` adjusted p-values (>= the raw ones).
  """
  raw = np.asarray(p, np.float64)
  if raw.ndim != 1 or not np.all((raw >= 0) & (raw <= 1)):
    raise ValueError(f"holm needs a list of p-values in [0, 1], got {raw.tolist()}")
  order = np.argsort(raw, kind="stable")
  scaled = np.minimum(1.0, (raw.size - np.arange(raw.size)) * raw[order])
  out = np.empty_like(raw)
  out[order] = np.maximum.accumulate(scaled)
  return out
