"""Monte Carlo checks of Props. 1 and 2 on a small discrete problem with a known partition function.

Problem: K = 40 outputs, pi_ref = softmax(N(0, 1)), 6 of them correct (r = 1), beta = 1.5, and a
proposal p_T = 0.7 * pi_ref-tilted(beta' = 0.8) + 0.3 * uniform, which over-weights correct outputs but
is not the target (so CV^2(w) ~ 0.1, small enough that the paper's second-order expansions hold).
All draws use fixed seeds; tolerances are stated next to each assertion.
"""
import numpy as np
import pytest

from disa_jax import estimators as E

K, BETA = 40, 1.5


@pytest.fixture(scope="module")
def problem():
  rng = np.random.default_rng(7)
  logits = rng.normal(size=K)
  ref = np.exp(logits - logits.max())
  ref /= ref.sum()
  r = np.zeros(K)
  r[rng.choice(K, 6, replace=False)] = 1.0
  tilt = ref * np.exp(0.8 * r)
  prop = 0.7 * tilt / tilt.sum() + 0.3 / K
  w = ref * np.exp(BETA * r) / prop  # importance weight of each output
  z = float(np.sum(ref * np.exp(BETA * r)))
  cv2 = float(np.sum(prop * w ** 2) / z ** 2 - 1.0)  # exact CV^2 under p_T
  e_log_w = float(np.sum(prop * np.log(w)))
  return dict(ref=ref, r=r, prop=prop, z=z, cv2=cv2, e_log_w=e_log_w)


def _draw(problem, n, repeats, seed):
  """[repeats, n] log w of i.i.d. draws from p_T, via the package's eq. (7)."""
  rng = np.random.default_rng(seed)
  idx = rng.choice(K, size=(repeats, n), p=problem["prop"])
  return np.asarray(E.log_importance_weights(np.log(problem["ref"][idx]), np.log(problem["prop"][idx]),
                                             problem["r"][idx], BETA))


def test_problem_is_in_the_small_cv2_regime(problem):
  assert 0.02 < problem["cv2"] < 0.5, problem["cv2"]


@pytest.mark.parametrize("n", [1, 4])
def test_prop1_linear_scale_unbiased(problem, n):
  repeats = 200_000
  z_hat = np.exp(np.asarray(E.log_z_is(_draw(problem, n, repeats, seed=n))).astype(np.float64))
  se = np.sqrt(problem["cv2"] / (n * repeats))  # standard error of mean(Z_hat) / Z
  assert abs(z_hat.mean() / problem["z"] - 1.0) < 5 * se


def test_prop1_log_bias_is_cv2_over_2n_and_shrinks_like_1_over_n(problem):
  repeats = 100_000
  bias = {}
  for n in (4, 8, 16, 32):
    lz = np.asarray(E.log_z_is(_draw(problem, n, repeats, seed=100 + n)), np.float64)
    bias[n] = np.log(problem["z"]) - lz.mean()
    se = lz.std() / np.sqrt(repeats)
    predicted = problem["cv2"] / (2 * n)
    # second-order delta method: within 20% of CV^2/(2N), plus 4 MC standard errors
    assert abs(bias[n] - predicted) < 0.2 * predicted + 4 * se, (n, bias[n], predicted)
    assert bias[n] > 0  # Jensen: biased downward
  for n in (4, 8, 16):
    ratio = bias[2 * n] / bias[n]
    assert 0.35 < ratio < 0.65, (n, ratio)  # halves when N doubles (1/N), up to MC noise


def test_prop2_gm_bias_is_cv2_over_2_and_does_not_shrink(problem):
  repeats = 50_000
  exact_gap = np.log(problem["z"]) - problem["e_log_w"]  # log Z - E_p[log w], the exact GM bias
  # second-order approximation of Prop. 2: within 25% of CV^2 / 2 in this regime
  assert abs(exact_gap - problem["cv2"] / 2) < 0.25 * problem["cv2"] / 2
  gaps = {}
  for n in (2, 8, 32):
    lz = np.asarray(E.log_z_gm(_draw(problem, n, repeats, seed=300 + n)), np.float64)
    gaps[n] = np.log(problem["z"]) - lz.mean()
    se = lz.std() / np.sqrt(repeats)
    assert abs(gaps[n] - exact_gap) < 4 * se + 1e-4, (n, gaps[n], exact_gap)
  # does not shrink with N (unlike log Z_IS): N = 32 keeps > 90% of the N = 2 bias
  assert gaps[32] > 0.9 * gaps[2]
  lz_is = np.asarray(E.log_z_is(_draw(problem, 32, repeats, seed=999)), np.float64)
  assert np.log(problem["z"]) - lz_is.mean() < 0.2 * gaps[32]  # LSE removes most of it at N = 32
