"""The controlled anchor (`disa_jax.anchor.noise`): offsets of RMS exactly sigma, fixed per seed and
prompt, and a table anchor built from them."""
import numpy as np
import pytest

from disa_jax.anchor import TableAnchor
from disa_jax.anchor.diagnostics import sigma_g
from disa_jax.anchor.noise import noise_offsets, noisy_log_z
from disa_jax.estimators.reward_transforms import RewardTransform

IDS = [f"sum_{n}" for n in range(41)]


@pytest.mark.parametrize("sigma", [0.25, 0.5, 1.0, 2.0])
def test_rms_is_sigma_exactly(sigma):
  eta = noise_offsets(IDS, sigma, seed=0)
  assert np.sqrt(np.mean(eta**2)) == pytest.approx(sigma, rel=1e-12)
  exact = {p: 10.0 + 0.1 * i for i, p in enumerate(IDS)}
  noisy = noisy_log_z(exact, sigma, seed=0)
  assert sigma_g(np.array([noisy[p] for p in IDS]), np.array([exact[p] for p in IDS])) == (
      pytest.approx(sigma, rel=1e-6))


def test_deterministic_per_seed_and_prompt():
  a = noise_offsets(IDS, 1.0, seed=3)
  np.testing.assert_array_equal(a, noise_offsets(IDS, 1.0, seed=3))
  # Each prompt's direction depends on (seed, id) only: a reordering permutes the offsets.
  perm = np.random.default_rng(0).permutation(len(IDS))
  np.testing.assert_allclose(noise_offsets([IDS[i] for i in perm], 1.0, seed=3), a[perm],
                             rtol=1e-12)
  # sigma only scales them; another seed draws other offsets.
  np.testing.assert_allclose(noise_offsets(IDS, 2.0, seed=3), 2.0 * a, rtol=1e-12)
  b = noise_offsets(IDS, 1.0, seed=4)
  assert np.abs(a - b).max() > 0.1 and abs(np.corrcoef(a, b)[0, 1]) < 0.5
  # The offsets vary across prompts (not a constant shift) and take both signs.
  assert (a > 0).any() and (a < 0).any() and a.std() > 0.5


def test_table_anchor_round_trip(tmp_path):
  exact = {p: float(i) for i, p in enumerate(IDS)}
  table = TableAnchor(noisy_log_z(exact, 0.5, seed=1), beta=15.0,
                      reward_transform=RewardTransform(kind="raw"), label_scale="sum",
                      source="exact+noise")
  table.save(tmp_path)
  loaded = TableAnchor.load(tmp_path)
  got = loaded.query(IDS) - np.array([exact[p] for p in IDS], np.float32)
  assert np.sqrt(np.mean(got.astype(np.float64)**2)) == pytest.approx(0.5, rel=1e-5)
  assert loaded.source == "exact+noise"


def test_bad_inputs_name_the_value():
  with pytest.raises(ValueError, match="sigma must be finite and > 0, got 0"):
    noise_offsets(IDS, 0.0, seed=0)
  with pytest.raises(ValueError, match="duplicate prompt ids .'sum_1'."):
    noise_offsets(["sum_1", "sum_1"], 1.0, seed=0)
  with pytest.raises(ValueError, match="at least one prompt id"):
    noise_offsets([], 1.0, seed=0)
