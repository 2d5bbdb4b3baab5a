"""`disa_jax.pipeline.censored`: steps to a level as interval-censored data on analytic curves
(left-, interval- and right-censored, and exact at step 0), and Gehan's permutation test: its
exact null distribution, its size under the null with censoring on both sides, its power, and the
left-censored comparators Welch saw as having no variance."""
import math

import numpy as np
import pytest

from disa_jax.pipeline import censored as CZ

I = CZ.Interval


def _p(t, rate):
  """An analytic P(correct) curve: 1 - 0.9 exp(-t / rate), reaching 0.9 at rate x ln 9."""
  return 1.0 - 0.9 * np.exp(-np.asarray(t, float) / rate)


def test_each_kind_of_censoring_on_analytic_curves():
  steps = np.arange(0, 201, 20)
  slow = CZ.time_to_level(steps, _p(steps, 50.0), 0.9)  # crosses at 109.9
  assert slow == I(100.0, 120.0, "interval") and 100 < 50 * math.log(9) <= 120
  late = steps[steps >= 40]  # first measured at 40, the curve crossed at 11.0
  assert CZ.time_to_level(late, _p(late, 5.0), 0.9) == I(0.0, 40.0, "left")
  assert CZ.time_to_level(steps, 0.95 + 0 * steps, 0.9) == I(0.0, 0.0, "exact")  # pi_ref there
  assert CZ.time_to_level(steps, _p(steps, 500.0), 0.9) == I(200.0, math.inf, "right")
  with pytest.raises(ValueError, match=r"increasing steps"):
    CZ.time_to_level([10, 10], [0.1, 0.2], 0.9)
  with pytest.raises(ValueError, match=r"kind in .* and 0 <= low <= high"):
    I(50.0, 40.0, "interval")


def test_pair_scores_order_only_what_the_intervals_order():
  left, first, second = I(0, 40, "left"), I(40, 80, "interval"), I(60, 100, "interval")
  never, zero = I(200, math.inf, "right"), I(0, 0, "exact")
  assert left.before(first) and not first.before(left)
  assert not first.before(second) and not second.before(first)  # they overlap: unknown
  assert first.before(never) and not never.before(never) and zero.before(left)
  assert not zero.before(zero) and not left.before(left)
  s = CZ.scores([left, first, never])
  np.testing.assert_array_equal(s, [[0, 1, 1], [-1, 0, 1], [-1, -1, 0]])


def test_left_censored_comparators_are_tested_not_seen_as_constant():
  """The off-policy report's pattern: every comparator run past the level at its first
  measurement (step 40), every DISA run between 40 and 120: Welch over the first measured steps
  sees zero variance; Gehan's test orders every cross pair, and with 5 + 5 runs the most
  extreme of the 252 splits (either side) gives p = 2 / 252."""
  comparator = [I(0, 40, "left")] * 5
  disa = [I(40, 80, "interval"), I(40, 80, "interval"), I(80, 120, "interval"),
          I(40, 80, "interval"), I(80, 120, "interval")]
  g = CZ.gehan_test(disa, comparator)
  assert g.u == -25 and g.effect == -1.0 and g.exact and g.splits == 252
  assert g.p == pytest.approx(2 / 252) and g.kinds[1]["left"] == 5
  mixed = CZ.gehan_test(disa, comparator[:3] + [I(40, 80, "interval")] * 2)
  assert mixed.p > g.p and -1 < mixed.effect < 0


def test_the_permutation_distribution_is_exact_or_seeded():
  rng = np.random.default_rng(0)
  a = [I(float(lo), float(lo) + 20, "interval") for lo in rng.integers(0, 10, 8) * 20]
  b = [I(float(lo), float(lo) + 20, "interval") for lo in rng.integers(2, 12, 8) * 20]
  exact = CZ.gehan_test(a, b)
  sampled = CZ.gehan_test(a, b, max_exact=0, draws=20000, seed=3)
  assert exact.exact and exact.splits == math.comb(16, 8) and not sampled.exact
  assert sampled.p == pytest.approx(exact.p, abs=0.01)
  assert CZ.gehan_test(a, b, max_exact=0, draws=20000, seed=3) == sampled  # seeded


def _experiment(rng, shift, n=5, every=20.0, first=40.0):
  """Two sides of ``n`` runs reaching the level at log-normal steps (B's x ``shift``), measured
  every ``every`` steps from ``first`` up to 200: censoring on both sides."""
  out = []
  for scale in (1.0, shift):
    side = []
    for t in 60.0 * scale * np.exp(0.5 * rng.normal(size=n)):
      grid = np.arange(first, 201.0, every)
      side.append(CZ.time_to_level(grid, (grid >= t).astype(float), 0.9))
    out.append(side)
  return out


def test_size_under_the_null_and_power_against_a_shift():
  rng = np.random.default_rng(1)
  null = [CZ.gehan_test(*_experiment(rng, 1.0)).p for _ in range(300)]
  assert np.mean(np.asarray(null) < 0.05) <= 0.06  # a valid test: at most alpha (+ MC error)
  shifted = [CZ.gehan_test(*_experiment(rng, 3.0)).p for _ in range(100)]
  assert np.mean(np.asarray(shifted) < 0.05) >= 0.6
