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
