"""Prop. 4 (the Cauchy-Schwarz envelope) on random instances, through the Stage 3 DISA loss."""
import jax.numpy as jnp
import numpy as np
import pytest

from disa_jax.anchor.diagnostics import anchor_error_envelope, inverse_variance_weights, sigma_g
from disa_jax.rl.losses import disa_loss


@pytest.mark.parametrize("seed", range(20))
def test_envelope_holds_on_random_instances(seed):
  rng = np.random.default_rng(seed)
  p, g, t = int(rng.integers(2, 8)), int(rng.integers(1, 6)), int(rng.integers(1, 5))
  b = p * g
  logp = rng.normal(-2, 1, size=(b, t)).astype(np.float32)
  ref = rng.normal(-2, 1, size=(b, t)).astype(np.float32)
  reward = rng.integers(0, 2, size=b).astype(np.float32)
  mask = np.ones((b, t), np.float32)
  log_z = rng.normal(size=p).astype(np.float32)
  eta = rng.normal(scale=float(rng.uniform(0.01, 3.0)), size=p).astype(np.float32)
  kw = dict(beta=float(rng.uniform(0.5, 15)), length_normalize=bool(seed % 2))
  l_exact = float(disa_loss(log_z, logp, ref, reward, mask, **kw)[0])
  l_anchor = float(disa_loss(log_z + eta, logp, ref, reward, mask, **kw)[0])
  sg = sigma_g(log_z + eta, log_z)  # equal rows per prompt: E over rows of eta^2 = mean over prompts
  assert abs(l_anchor - l_exact) <= anchor_error_envelope(sg, l_exact) * (1 + 1e-5) + 1e-5


def test_envelope_is_tight_for_constant_residuals():
  # when every exact residual equals c and eta is constant, the bound holds with equality
  c, eta = 0.7, 0.3
  logp = np.full((4, 1), -1.0, np.float32)
  ref = logp - c  # residual = log Z + c - beta r, with log Z = 0 and r = 0
  args = (logp, ref, np.zeros(4, np.float32), np.ones((4, 1), np.float32))
  l_exact = float(disa_loss(jnp.zeros(2), *args, beta=1.0, length_normalize=False)[0])
  l_anchor = float(disa_loss(jnp.full(2, eta), *args, beta=1.0, length_normalize=False)[0])
  assert l_anchor - l_exact == pytest.approx(anchor_error_envelope(eta, l_exact), rel=1e-5)


def test_inverse_variance_weights():
  w = inverse_variance_weights(np.array([0.0, 0.8, np.nan, 3.2]), np.array([8, 8, 8, 8]), floor=0.01)
  raw = 1 / np.maximum(np.array([0.0, 0.1, 0.0, 0.4]), 0.01)
  np.testing.assert_allclose(w, raw / raw.mean())
  with pytest.raises(ValueError, match="floor"):
    inverse_variance_weights(np.ones(2), np.ones(2), floor=0.0)


def test_generalisation_against_hand_computed_values():
  """R^2 around the prompts' own mean, sigma_g, and the constant predictor's sigma."""
  from disa_jax.anchor.diagnostics import generalisation
  log_z = np.array([1.0, 2.0, 3.0, 6.0])  # mean 3, SST 14
  pred = np.array([1.5, 2.0, 2.0, 5.0])  # SSE 0.25 + 0 + 1 + 1 = 2.25
  g = generalisation(pred, log_z, constant=2.0)
  assert g["r2"] == pytest.approx(1 - 2.25 / 14)
  assert g["sigma_g"] == pytest.approx(np.sqrt(2.25 / 4))
  assert g["sigma_constant"] == pytest.approx(np.sqrt((1 + 0 + 1 + 16) / 4))
  assert g["sigma_g_over_constant"] == pytest.approx(np.sqrt(2.25 / 18))
  assert g["log_z_range"] == 5.0 and g["prompts"] == 4
  assert generalisation(np.full(4, 3.0), log_z, 3.0)["r2"] == pytest.approx(0.0)
