"""App. D.3 tools: subsampling without replacement, the variance/bias trend, k-means, elbow, strata."""
import jax
import numpy as np
import pytest

from disa_jax import estimators as E


def test_subsample_full_pool_equals_pool_estimate():
  lw = np.random.default_rng(0).normal(size=(4, 8)).astype(np.float32)
  lz = np.asarray(E.subsample_log_z(jax.random.key(0), lw, np.ones_like(lw, bool), m=8, repeats=5))
  np.testing.assert_allclose(lz, np.broadcast_to(np.asarray(E.log_z_is(lw)), (5, 4)), rtol=1e-5, atol=1e-6)


def test_subsample_is_without_replacement():
  # distinct powers of two as weights: the subset sum identifies the chosen subset exactly
  lw = np.log(2.0 ** np.arange(6))[None].astype(np.float32)
  lz = np.asarray(E.subsample_log_z(jax.random.key(1), lw, np.ones((1, 6), bool), m=3, repeats=200))[:, 0]
  sums = np.rint(np.exp(lz.astype(np.float64)) * 3).astype(int)
  assert all(bin(s).count("1") == 3 for s in sums)  # three distinct elements each time
  assert len(set(sums.tolist())) > 10  # and many different subsets


def test_respects_mask_and_marks_short_rows_nan():
  lw = np.zeros((2, 6), np.float32)
  lw[0, 4:] = 50.0  # invalid entries with huge weights must never be drawn
  mask = np.array([[1, 1, 1, 1, 0, 0], [1, 1, 0, 0, 0, 0]], bool)
  lz = np.asarray(E.subsample_log_z(jax.random.key(2), lw, mask, m=3, repeats=50))
  np.testing.assert_allclose(lz[:, 0], 0.0, atol=1e-6)
  assert np.isnan(lz[:, 1]).all()


def test_variance_and_relative_bias_decrease_with_m():
  rng = np.random.default_rng(3)
  lw = rng.normal(scale=1.5, size=(200, 32)).astype(np.float32)  # CV^2 ~ e^{2.25}-1
  res = E.n_study(jax.random.key(3), lw, ms=(2, 4, 8, 16), repeats=32)
  s = res.summary()
  var = [row["variance_mean"] for row in s]
  rel = [row["relative_bias_median"] for row in s]
  assert all(a > b for a, b in zip(var, var[1:])), var
  assert all(a > b for a, b in zip(rel, rel[1:])), rel
  assert var[2] < 0.5 * var[0]  # the paper's M=8 vs M=2 drop is ~75%
  assert res.variance.shape == (4, 200)
  with pytest.raises(ValueError, match="repeats"):
    E.n_study(jax.random.key(0), lw, repeats=1)


def test_kmeans_elbow_and_stratified_subset():
  rng = np.random.default_rng(4)
  centres = rng.normal(scale=10.0, size=(4, 5))
  sizes = [100, 50, 30, 20]
  x = np.concatenate([c + rng.normal(size=(s, 5)) for c, s in zip(centres, sizes)]).astype(np.float32)
  truth = np.repeat(np.arange(4), sizes)
  _, labels, sse = E.kmeans(jax.random.key(0), x, k=4)
  labels = np.asarray(labels)
  for c in range(4):  # each true cluster maps to one label
    assert len(set(labels[truth == c].tolist())) == 1
  ks = [1, 2, 3, 4, 5, 6, 7, 8]
  curve = E.sse_curve(jax.random.key(1), x, ks)
  assert all(a >= b - 1e-3 * a for a, b in zip(curve, curve[1:]))
  assert E.elbow_k(ks, curve) in (3, 4)  # the chord-distance elbow of a 4-blob set
  idx = E.stratified_subset(jax.random.key(2), labels, 40)
  assert len(idx) == 40 and len(set(idx.tolist())) == 40
  counts = np.bincount(truth[idx], minlength=4)
  np.testing.assert_allclose(counts, np.array(sizes) / 200 * 40, atol=1)
