import jax.numpy as jnp
import numpy as np
import pytest

from disa_jax import codec
from disa_jax.estimators import RewardTransform, transform_rewards


def test_raw_affine_zscore_values():
  r = np.array([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 0.0]])
  np.testing.assert_allclose(RewardTransform().apply(r), r)
  np.testing.assert_allclose(RewardTransform(kind="affine", scale=2.0, shift=-1.0).apply(r), 2 * r - 1)
  z = np.asarray(RewardTransform(kind="group_zscore", eps=0.0 + 1e-12).apply(r))
  np.testing.assert_allclose(z[0], [1, -1, -1, 1], atol=1e-5)  # mean .5, population std .5
  np.testing.assert_allclose(z[1], (r[1] - 0.75) / np.sqrt(0.1875), atol=1e-5)


def test_zscore_degenerate_and_masked_groups():
  r = np.array([[1.0, 1.0, 1.0], [0.0, 0.0, 5.0]])
  mask = np.array([[1, 1, 1], [1, 1, 0]], bool)
  z = np.asarray(transform_rewards(r, mask, kind="group_zscore"))
  np.testing.assert_allclose(z, 0.0, atol=1e-6)  # all-equal groups map to 0; masked entry -> 0
  sliced = np.asarray(transform_rewards(np.array([[0.0, 1.0]]), kind="group_zscore"))
  masked = np.asarray(transform_rewards(np.array([[0.0, 9.0, 1.0]]), np.array([[1, 0, 1]], bool),
                                        kind="group_zscore"))
  np.testing.assert_allclose(masked[0, [0, 2]], sliced[0], rtol=1e-6)


def test_errors_and_roundtrip():
  with pytest.raises(ValueError, match="kind"):
    RewardTransform(kind="softmax")
  with pytest.raises(ValueError, match="scale"):
    RewardTransform(kind="affine", scale=-1.0)
  t = RewardTransform(kind="affine", scale=3.0, shift=1.0)
  assert codec.decode(RewardTransform, codec.encode(t), "reward_transform") == t
  with pytest.raises(ValueError, match="unknown fields"):
    codec.decode(RewardTransform, {"kind": "raw", "bogus": 1}, "reward_transform")
  with pytest.raises(ValueError, match="mismatch"):
    t.check_matches(RewardTransform())
