"""`disa_jax.pipeline.seed_stats`: Welch's test against scipy, and the Monte Carlo error floor."""
import numpy as np
import pytest
from scipy import stats

from disa_jax.pipeline import seed_stats as S


@pytest.mark.parametrize("a,b", [
    ([0.171 - 0.016, 0.171, 0.171 + 0.016], [0.340 - 0.164, 0.340, 0.340 + 0.164]),
    ([1.0, 1.2, 0.9, 1.1, 1.05], [2.0, 2.5, 1.7]),
    ([0.3, 0.31], [0.5, 0.9, 0.7, 0.65, 0.8, 0.66]),
])
def test_welch_matches_scipy(a, b):
  c = S.welch(a, b)
  ref = stats.ttest_ind(a, b, equal_var=False)
  assert c.t == pytest.approx(ref.statistic, rel=1e-10)
  assert c.p == pytest.approx(ref.pvalue, rel=1e-8)
  assert c.diff == pytest.approx(np.mean(a) - np.mean(b))
  ci = ref.confidence_interval(0.95)
  assert (c.ci_low, c.ci_high) == (pytest.approx(ci.low, rel=1e-8), pytest.approx(ci.high, rel=1e-8))


def test_the_documented_three_seed_gap_is_not_significant():
  # docs/real_checkpoints.md's pos_replay 0.171 ± 0.016 against DISA 0.340 ± 0.164 (issue 26)
  c = S.welch([0.155, 0.171, 0.187], [0.176, 0.340, 0.504])
  assert c.diff < 0 and c.p == pytest.approx(0.217, abs=0.01) and not c.below()
  assert S.welch([0.1, 0.11, 0.12, 0.1, 0.115], [0.3, 0.32, 0.29, 0.31, 0.3]).below()


def test_monte_carlo_errors_floor_the_spread_across_seeds():
  a, b = [1.0, 1.001, 0.999], [1.1, 1.101, 1.099]  # seeds agree far better than one evaluation
  assert S.welch(a, b).p < 1e-4
  c = S.welch(a, b, a_se=[0.1] * 3, b_se=[0.1] * 3)
  assert c.se == pytest.approx(np.sqrt(2 * 0.01 / 3)) and c.p > 0.2 and not c.below()


def test_t_distribution_pieces_match_scipy():
  for df in (1.0, 2.5, 7.0, 40.0):
    for t in (0.1, 1.0, 2.2, 6.0):
      assert S.t_two_sided_p(t, df) == pytest.approx(2 * stats.t.sf(t, df), rel=1e-9)
    assert S.t_quantile(0.975, df) == pytest.approx(stats.t.ppf(0.975, df), rel=1e-9)
  assert S.betainc(2.0, 3.0, 0.4) == pytest.approx(stats.beta.cdf(0.4, 2.0, 3.0), rel=1e-12)


def test_bad_input_names_the_side_and_values():
  with pytest.raises(ValueError, match="needs >= 2 seeds on side a, got 1"):
    S.welch([1.0], [1.0, 2.0])
  with pytest.raises(ValueError, match="non-finite values on side b"):
    S.welch([1.0, 2.0], [1.0, float("nan")])
  with pytest.raises(ValueError, match="one per value"):
    S.welch([1.0, 2.0], [1.0, 2.0], b_se=[0.1])
  with pytest.raises(ValueError, match="both sides are constant"):
    S.welch([1.0, 1.0], [2.0, 2.0])


@pytest.mark.parametrize("table", [(0, 3, 3, 3), (0, 5, 3, 3), (3, 5, 0, 5), (1, 4, 4, 4), (2, 5, 2, 5),
                                   (0, 5, 0, 5), (5, 5, 5, 5), (1, 10, 7, 9), (4, 12, 3, 3)])
def test_fisher_exact_matches_scipy(table):
  ka, na, kb, nb = table
  ref = stats.fisher_exact([[ka, na - ka], [kb, nb - kb]]).pvalue
  assert S.fisher_exact(ka, na, kb, nb) == pytest.approx(ref, rel=1e-9)


def test_fisher_exact_matches_scipy_on_every_small_table():
  for na in range(1, 7):
    for nb in range(1, 7):
      for ka in range(na + 1):
        for kb in range(nb + 1):
          ref = stats.fisher_exact([[ka, na - ka], [kb, nb - kb]]).pvalue
          assert S.fisher_exact(ka, na, kb, nb) == pytest.approx(ref, rel=1e-9), (ka, na, kb, nb)


def test_the_issues_collapse_counts():
  assert S.fisher_exact(3, 3, 0, 3) == pytest.approx(0.1)  # 3/3 against 0/3: p = 0.10
  with pytest.raises(ValueError, match="side b: needs 0 <= events <= n"):
    S.fisher_exact(1, 3, 4, 3)


def test_holm_is_the_step_down_procedure():
  rng = np.random.default_rng(0)
  for _ in range(200):
    p = rng.uniform(0, 0.1, rng.integers(1, 8)) ** rng.uniform(0.5, 2)
    adj = S.holm(p)
    for alpha in (0.01, 0.05, 0.1):
      rejected, order = set(), np.argsort(p)  # Holm (1979): reject in order while p_(i) <= a/(m-i)
      for i, j in enumerate(order):
        if p[j] > alpha / (p.size - i):
          break
        rejected.add(int(j))
      assert {int(j) for j in np.flatnonzero(adj <= alpha)} == rejected
  assert S.holm([0.013, 0.018, 0.015, 0.04]).tolist() == pytest.approx([0.052, 0.052, 0.052, 0.052])
  assert S.holm([0.01, 0.5]).tolist() == [0.02, 0.5] and S.holm([]).size == 0
  with pytest.raises(ValueError, match="p-values in"):
    S.holm([0.5, 1.2])


def test_one_sample_matches_scipy():
  x = [0.3, -0.1, 0.5, 0.2, 0.25, 0.4]
  t = S.one_sample(x)
  ref = stats.ttest_1samp(x, 0.0)
  assert t.p == pytest.approx(ref.pvalue, rel=1e-9) and t.mean == pytest.approx(np.mean(x))
  ci = ref.confidence_interval(0.95)
  assert (t.ci_low, t.ci_high) == (pytest.approx(ci.low, rel=1e-9), pytest.approx(ci.high, rel=1e-9))
  with pytest.raises(ValueError, match="constant"):
    S.one_sample([1.0, 1.0])


def test_tost_is_the_90_percent_interval_inside_the_margin():
  a, b = [0.30, 0.31, 0.29, 0.305, 0.3], [0.3, 0.29, 0.31, 0.3, 0.295]
  c = S.welch(a, b, level=0.9)
  inside = max(abs(c.ci_low), abs(c.ci_high))  # the margin where the interval just fits
  assert c.tost_p(inside * 1.001) < 0.05 < c.tost_p(inside * 0.999)
  lo = stats.t.sf((c.diff + 0.05) / c.se, c.df)  # each one-sided test against scipy
  hi = stats.t.sf((0.05 - c.diff) / c.se, c.df)
  assert c.tost_p(0.05) == pytest.approx(max(lo, hi), rel=1e-9)


def test_fisher_min_p_is_the_smallest_p_the_margins_allow():
  assert S.fisher_min_p(3, 3, 3) == pytest.approx(0.1)  # 3/3 against 0/3 at best
  assert S.fisher_min_p(5, 5, 5) == pytest.approx(2 / 252)
  assert S.fisher_min_p(0, 5, 5) == 1.0 and S.fisher_min_p(10, 5, 5) == 1.0
  for na, nb, k in ((4, 6, 3), (5, 3, 4), (2, 7, 5)):
    every = [stats.fisher_exact([[x, na - x], [k - x, nb - k + x]]).pvalue
             for x in range(max(0, k - nb), min(na, k) + 1)]
    assert S.fisher_min_p(k, na, nb) == pytest.approx(min(every), rel=1e-9)
