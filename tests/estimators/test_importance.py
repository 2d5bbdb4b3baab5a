"""Stage 1 estimators: analytic values, edge cases, invariants (jit vs no-jit, masked vs sliced)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.special import logsumexp

from disa_jax import estimators as E


def _rand_logw(seed, p=5, n=7):
  rng = np.random.default_rng(seed)
  return rng.normal(scale=2.0, size=(p, n)).astype(np.float32)


def test_log_importance_weights_eq7():
  lr = np.array([[-3.0, -1.0]], np.float32)
  lp = np.array([[-2.0, -0.5]], np.float32)
  r = np.array([[1.0, 0.0]], np.float32)
  lw = E.log_importance_weights(lr, lp, r, 15.0)
  np.testing.assert_allclose(lw, [[-3 + 2 + 15, -1 + 0.5]], rtol=1e-6)
  lw_m = E.log_importance_weights(lr, lp, r, 15.0, mask=np.array([[True, False]]))
  assert np.isneginf(lw_m[0, 1]) and lw_m[0, 0] == pytest.approx(14.0)


def test_analytic_values():
  w = np.array([[1.0, 2.0, 3.0, 4.0]])
  lw = jnp.log(w)
  assert float(E.log_z_is(lw)[0]) == pytest.approx(np.log(2.5), rel=1e-6)
  assert float(E.log_z_gm(lw)[0]) == pytest.approx(np.mean(np.log(w)), rel=1e-6)
  assert float(E.effective_sample_size(lw)[0]) == pytest.approx(100 / 30, rel=1e-5)
  cv2 = np.var(w) / np.mean(w) ** 2
  assert float(E.cv_squared(lw)[0]) == pytest.approx(cv2, rel=1e-5)
  assert float(E.max_weight_share(lw)[0]) == pytest.approx(0.4, rel=1e-5)
  # ESS = N / (1 + CV^2)
  assert float(E.effective_sample_size(lw)[0]) == pytest.approx(4 / (1 + cv2), rel=1e-5)


def test_matches_scipy_and_is_stable_for_large_logits():
  lw = _rand_logw(0) * 50 + 1000.0  # overflow in linear scale; fine in log space
  ref = logsumexp(lw.astype(np.float64), axis=1) - np.log(lw.shape[1])
  np.testing.assert_allclose(E.log_z_is(lw), ref, rtol=1e-6)


def test_edge_cases_documented_behaviour():
  lw = np.array([
      [0.0, -np.inf, 1.0],  # a zero weight still counts in N
      [-np.inf, -np.inf, -np.inf],  # all weights zero
      [0.3, 0.0, 0.0],  # no valid sample (mask)
      [0.7, 0.0, 0.0],  # N = 1 (mask)
  ], np.float32)
  mask = np.array([[1, 1, 1], [1, 1, 1], [0, 0, 0], [1, 0, 0]], bool)
  s = {k: np.asarray(v) for k, v in E.stage1_statistics(lw, mask).items()}
  assert s["log_z_is"][0] == pytest.approx(np.log((1 + 0 + np.e) / 3), rel=1e-6)
  assert np.isneginf(s["log_z_gm"][0])
  assert np.isneginf(s["log_z_is"][1]) and np.isneginf(s["log_z_gm"][1])
  assert s["ess"][1] == 0 and np.isnan(s["cv2"][1]) and np.isnan(s["max_weight_share"][1])
  assert np.isnan(s["log_z_is"][2]) and np.isnan(s["log_z_gm"][2]) and s["ess"][2] == 0
  assert s["n_valid"].tolist() == [3, 3, 0, 1]
  assert s["log_z_is"][3] == pytest.approx(0.7) and s["log_z_gm"][3] == pytest.approx(0.7)
  assert s["ess"][3] == pytest.approx(1.0) and s["cv2"][3] == pytest.approx(0.0, abs=1e-6)
  assert s["max_weight_share"][3] == pytest.approx(1.0)


@pytest.mark.parametrize("fn", [E.log_z_is, E.log_z_gm, E.effective_sample_size, E.cv_squared,
                                E.max_weight_share])
def test_jit_vs_nojit_and_masked_vs_sliced(fn):
  lw = _rand_logw(1, p=6, n=8)
  n_valid = np.array([8, 5, 3, 1, 7, 2])
  mask = np.arange(8)[None, :] < n_valid[:, None]
  garbage = np.where(mask, lw, 123.0)  # masked-out entries must not matter
  masked = np.asarray(fn(garbage, mask))
  with jax.disable_jit():
    nojit = np.asarray(fn(garbage, mask))
  np.testing.assert_allclose(masked, nojit, rtol=1e-5, atol=1e-6)
  for i, k in enumerate(n_valid):
    sliced = np.asarray(fn(lw[i:i + 1, :k]))[0]
    np.testing.assert_allclose(masked[i], sliced, rtol=1e-5, atol=1e-6)


def test_jensen_correction_adds_cv2_over_2n():
  lz = jnp.array([1.0, 2.0])
  out = E.jensen_corrected_log_z(lz, jnp.array([0.5, jnp.nan]), jnp.array([4, 4]))
  np.testing.assert_allclose(out, [1.0 + 0.5 / 8, 2.0], rtol=1e-6)
