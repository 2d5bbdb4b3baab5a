"""Stage 2 label / weighting selector: each variant equals its estimator, weights, and bad names."""
import numpy as np
import pytest

from disa_jax import estimators as E
from disa_jax.anchor.diagnostics import inverse_variance_weights
from disa_jax.anchor.labels import LABEL_VARIANTS, WEIGHTINGS, anchor_targets, targets_from_log_weights

BETA = 2.0


def _stage1(p=7, n=6, seed=0):
  """A small ragged Stage 1 dataset built through the real record path."""
  rng = np.random.default_rng(seed)
  samples = []
  for i in range(p):
    k = 1 + (i % n)  # 1 .. n samples per prompt
    samples.append([{"token_ids": [1, 2], "text": "x", "logp_ref": float(rng.normal(-3, 1)),
                     "logp_proposal": float(rng.normal(-2, 1)), "reward": float(rng.integers(0, 2)),
                     "num_tokens": 2} for _ in range(k)])
  recs = E.build_records([f"q{i}" for i in range(p)], [f"prompt {i}" for i in range(p)], samples, beta=BETA,
                         reward_transform=E.RewardTransform(kind="raw"))
  return recs


@pytest.fixture(scope="module")
def data(tmp_path_factory):
  path = tmp_path_factory.mktemp("labels") / "s1.jsonl"
  E.Stage1Writer(path).write(_stage1())
  return E.load_stage1(path)


def test_plain_uniform_is_the_papers_eq7_target(data):
  labels, weights = anchor_targets(data)
  assert weights is None
  np.testing.assert_allclose(labels, data.labels, rtol=1e-5, atol=1e-5)  # the stored eq. (8) labels


def test_each_variant_equals_its_estimator(data):
  lw, mask = data.log_weights(), data.mask
  lz = np.asarray(E.log_z_is(lw, mask), np.float64)
  cv2 = np.asarray(E.cv_squared(lw, mask), np.float64)
  n = mask.sum(-1)
  jensen, _ = anchor_targets(data, "jensen")
  np.testing.assert_allclose(jensen, lz + np.nan_to_num(cv2) / (2 * n), rtol=1e-6, atol=1e-6)
  assert np.all(jensen >= lz - 1e-6)  # the correction only moves labels up (Jensen bias is downward)
  jack, _ = anchor_targets(data, "jackknife")
  np.testing.assert_allclose(jack, np.asarray(E.jackknife_log_z(lw, mask)), rtol=1e-6, atol=1e-6)
  assert jack[n == 1] == pytest.approx(lz[n == 1])  # one sample: no leave-one-out estimate, plain label


def test_inverse_variance_weights(data):
  for variant in LABEL_VARIANTS:
    labels, w = anchor_targets(data, variant, "inverse_variance", floor=0.05)
    cv2 = np.asarray(E.cv_squared(data.log_weights(), data.mask), np.float64)
    np.testing.assert_allclose(w, inverse_variance_weights(cv2, data.mask.sum(-1), 0.05))
    assert w.mean() == pytest.approx(1.0) and np.all(w > 0)
    assert labels.shape == w.shape == (len(data.prompt_ids),)
  # a larger label variance CV^2 / N gets a smaller weight
  var = np.maximum(np.nan_to_num(cv2) / data.mask.sum(-1), 0.05)
  assert np.all(np.diff(w[np.argsort(var)]) <= 1e-12)


def test_row_without_samples_gives_nan_label():
  lw = np.array([[0.0, 1.0], [2.0, 3.0]], np.float32)
  mask = np.array([[True, True], [False, False]])
  for v in LABEL_VARIANTS:
    labels, _ = targets_from_log_weights(lw, mask, v)
    assert np.isfinite(labels[0]) and np.isnan(labels[1]), v


@pytest.mark.parametrize("kw, field", [({"variant": "median"}, "variant='median'"),
                                       ({"weighting": "ess"}, "weighting='ess'"),
                                       ({"floor": 0.0}, "floor=0.0")])
def test_bad_options_name_field_and_value(data, kw, field):
  with pytest.raises(ValueError, match=field):
    anchor_targets(data, **kw)
  assert "plain" in LABEL_VARIANTS and "uniform" in WEIGHTINGS


def test_shape_errors():
  with pytest.raises(ValueError, match="mask"):
    targets_from_log_weights(np.zeros((2, 3)), np.ones((2, 2), bool))
