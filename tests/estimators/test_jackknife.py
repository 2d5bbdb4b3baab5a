"""The jackknife bias-corrected log Z_IS label: brute-force parity, edge cases, and its O(1/N^2) bias.

The bias test is exact, not Monte Carlo: a 4-output problem (pi_ref, p_T, r, beta below, so Z is known)
whose N-sample estimators depend only on the counts of each output, so E[L_N] and E[J_N] are sums over
all count vectors weighted by their multinomial probabilities (6545 count vectors at N = 32).
"""
import itertools

import jax
import numpy as np
import pytest
from scipy.special import gammaln, logsumexp

from disa_jax import estimators as E

REF = np.array([0.5, 0.3, 0.15, 0.05])
PROP = np.array([0.45, 0.4, 0.1, 0.05])  # under-samples the two correct outputs: CV^2(w) ~ 1.19
R = np.array([0.0, 0.0, 1.0, 1.0])
BETA = 1.5


def _brute(row: np.ndarray) -> float:
  """N L_N - (N - 1) mean_i L_{N-1}^{(-i)} in float64 by deleting each sample."""
  n = row.size
  full = logsumexp(row) - np.log(n)
  if n == 1:
    return full
  loo = [logsumexp(np.delete(row, i)) - np.log(n - 1) for i in range(n)]
  return n * full - (n - 1) * np.mean(loo)


def test_matches_brute_force_on_ragged_rows():
  rng = np.random.default_rng(0)
  log_w = (rng.normal(size=(6, 9)) * 3.0).astype(np.float32)
  n_valid = np.array([9, 5, 2, 1, 7, 3])
  mask = np.arange(9)[None, :] < n_valid[:, None]
  log_w_garbage = np.where(mask, log_w, 1e4).astype(np.float32)  # masked entries must be ignored
  out = np.asarray(E.jackknife_log_z(log_w_garbage, mask))
  for p in range(6):
    want = _brute(log_w[p, :n_valid[p]].astype(np.float64))
    assert abs(out[p] - want) < 1e-4 * max(1.0, abs(want)), (p, out[p], want)
  # masked == sliced, and jit == no jit
  sliced = np.asarray(E.jackknife_log_z(log_w[1:2, :5]))
  assert np.allclose(out[1], sliced[0], atol=1e-6)
  with jax.disable_jit():
    nojit = np.asarray(E.jackknife_log_z(log_w_garbage, mask))
  np.testing.assert_allclose(nojit, out, rtol=1e-5, atol=1e-5)


def test_exact_when_one_weight_dominates():
  # leave-one-out sums are formed directly, not by subtracting the dominant weight in float32
  row = np.array([[50.0, 0.0, 0.0, 0.0]], np.float32)
  assert abs(float(E.jackknife_log_z(row)[0]) - _brute(row[0].astype(np.float64))) < 1e-3


def test_edge_cases():
  ninf = -np.inf
  log_w = np.array([[0.3, 1.0, 2.0],  # no valid sample -> NaN
                    [1.7, 5.0, 5.0],  # N = 1 -> L_1
                    [ninf, ninf, 0.0],  # all weights 0 -> -inf
                    [2.0, ninf, 0.0]], np.float32)  # one nonzero weight -> L_N (correction would be +inf)
  mask = np.array([[0, 0, 0], [1, 0, 0], [1, 1, 0], [1, 1, 0]], bool)
  out = np.asarray(E.jackknife_log_z(log_w, mask))
  assert np.isnan(out[0])
  assert out[1] == pytest.approx(1.7)
  assert out[2] == -np.inf
  assert out[3] == pytest.approx(2.0 - np.log(2.0), abs=1e-6)
  assert np.all(np.isfinite(np.asarray(E.jackknife_log_z(log_w[1:], mask[1:]))[np.array([0, 2])]))


def _compositions(n: int, k: int) -> np.ndarray:
  """All count vectors of n draws over k outputs, ``[C, k]``."""
  out = []
  for cut in itertools.combinations(range(n + k - 1), k - 1):
    b = (-1,) + cut + (n + k - 1,)
    out.append([b[i + 1] - b[i] - 1 for i in range(k)])
  return np.asarray(out)


@pytest.fixture(scope="module")
def exact_biases():
  w = REF * np.exp(BETA * R) / PROP
  log_z = np.log(np.sum(REF * np.exp(BETA * R)))
  cv2 = float(np.sum(PROP * w ** 2) / np.exp(2 * log_z) - 1.0)
  out = {}
  for n in (2, 4, 8, 16, 32):
    counts = _compositions(n, len(REF))  # [C, 4]
    pmf = np.exp(gammaln(n + 1) - gammaln(counts + 1).sum(1) + (counts * np.log(PROP)).sum(1))  # [C]
    idx = np.stack([np.repeat(np.arange(len(REF)), c) for c in counts])  # [C, n] output of each draw
    lw = E.log_importance_weights(np.log(REF[idx]), np.log(PROP[idx]), R[idx], BETA)  # eq. (7), [C, n]
    plain = np.asarray(E.log_z_is(lw), np.float64)
    jack = np.asarray(E.jackknife_log_z(lw), np.float64)
    out[n] = (abs(pmf.sum() - 1.0), log_z - pmf @ plain, log_z - pmf @ jack)
  return cv2, out


def test_plain_bias_is_cv2_over_2n_exactly_enumerated(exact_biases):
  cv2, out = exact_biases
  assert 1.0 < cv2 < 1.4, cv2
  for n in (8, 16, 32):
    total, b_plain, _ = out[n]
    assert total < 1e-9
    assert abs(n * b_plain - cv2 / 2) < 0.03 * cv2 / 2 + 0.02, (n, n * b_plain, cv2 / 2)  # Prop. 1


def test_jackknife_bias_is_order_one_over_n_squared(exact_biases):
  _, out = exact_biases
  for n, (_, b_plain, b_jack) in out.items():
    assert n * (n - 1) * abs(b_jack) < 0.45, (n, b_jack)  # |bias| <= c / (N (N - 1)) with one c for all N
    if n >= 8:
      assert abs(b_jack) < 0.1 * abs(b_plain), (n, b_jack, b_plain)
  assert abs(out[32][2]) < abs(out[32][1]) / 50  # at N = 32 the jackknife leaves < 2% of the Jensen bias
