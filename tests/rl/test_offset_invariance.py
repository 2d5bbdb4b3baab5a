"""Prop. 3(ii) and App. C.5, checked exactly on an enumerable policy through the Stage 3 TB loss.

A softmax policy pi_theta over K whole responses of different lengths; the expected gradient of the
TB loss under a behaviour mu is sum_k mu_k grad (R_k^2) (mu held fixed), computed by `tb_loss` on
all K responses with sample weights mu. Adding a per-prompt offset c to log Z changes it by
2 c sum_k mu_k omega_k grad s_k, where s_k is the residual's log-prob term: zero on-policy with the
sum-scale residual (E_pi[grad log pi] = 0), not zero with the length-normalised residual
(c/|o| correlates with the sample) nor off-policy (it is 2 c (mu - pi) in logit space: App. C.5's
2 eta E_mu[grad log pi]); exact importance weights pi/mu restore the invariance, clipped ones don't.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from disa_jax.rl import losses

K, T, BETA, C = 6, 4, 3.0, 1.7
LENGTHS = np.array([1, 2, 4, 3, 1, 4])
THETA = np.array([0.3, -1.2, 0.8, 0.0, -0.4, 1.1], np.float32)
REF = np.log(np.array([0.1, 0.2, 0.15, 0.25, 0.2, 0.1], np.float32))
REWARD = np.array([1, 0, 1, 1, 0, 0], np.float32)
LOG_Z = float(np.log(np.sum(np.exp(REF + BETA * REWARD))))
MASK = (np.arange(T)[None] < LENGTHS[:, None]).astype(np.float32)


def _tokens(seq_logp):
  """``[K]`` sequence log-probs -> ``[K, T]`` token log-probs whose sum over the mask is it."""
  return jnp.zeros((K, T)).at[:, 0].set(seq_logp) * MASK


def expected_gradient(theta, offset, *, scale, behaviour=None, omega="one"):
  """sum_k mu_k grad_theta [omega_k R_k^2] with mu = ``behaviour`` (None: pi_theta, on-policy)."""

  def loss(th):
    logp = jax.nn.log_softmax(th)
    mu = jax.lax.stop_gradient(jnp.exp(logp)) if behaviour is None else behaviour
    return losses.tb_loss(jnp.array([LOG_Z + offset]), _tokens(logp), _tokens(REF), REWARD, MASK,
                          beta=BETA, length_normalize=scale == "mean",
                          old_logp=_tokens(jnp.log(mu)), omega_mode=omega,
                          omega_eps_low=0.2, omega_eps_high=0.2, sample_weight=K * mu)[0]

  return np.asarray(jax.grad(loss)(jnp.asarray(theta)), np.float64)


def _pi(theta):
  return np.exp(theta - theta.max()) / np.exp(theta - theta.max()).sum()


def test_on_policy_sum_scale_gradient_ignores_the_offset():
  g0 = expected_gradient(THETA, 0.0, scale="sum")
  assert np.abs(g0).max() > 0.1  # a gradient to speak of
  for c in (C, -4.0, 25.0):
    np.testing.assert_allclose(expected_gradient(THETA, c, scale="sum"), g0, atol=1e-5)


def test_mean_scale_gradient_moves_with_the_offset():
  pi = _pi(THETA)
  diff = expected_gradient(THETA, C, scale="mean") - expected_gradient(THETA, 0.0, scale="mean")
  # 2 c sum_k pi_k grad(log pi_k) / |o_k|, with grad_theta log pi_k = e_k - pi.
  want = 2 * C * (pi / LENGTHS - pi * np.sum(pi / LENGTHS))
  np.testing.assert_allclose(diff, want, rtol=1e-4, atol=1e-6)
  assert np.abs(diff).max() > 0.05


def test_off_policy_gradient_moves_with_the_offset_as_app_c5():
  pi = _pi(THETA)
  mu = _pi(np.zeros(K, np.float32))  # a fixed behaviour != pi
  diff = (expected_gradient(THETA, C, scale="sum", behaviour=jnp.asarray(mu)) -
          expected_gradient(THETA, 0.0, scale="sum", behaviour=jnp.asarray(mu)))
  np.testing.assert_allclose(diff, 2 * C * (mu - pi), rtol=1e-4, atol=1e-6)
  assert np.abs(diff).max() > 0.1


@pytest.mark.parametrize("omega,invariant", [("ratio", True), ("clamped_ratio", False)])
def test_importance_weights_restore_it_only_unclipped(omega, invariant):
  mu = jnp.asarray(_pi(np.zeros(K, np.float32)))
  diff = (expected_gradient(THETA, C, scale="sum", behaviour=mu, omega=omega) -
          expected_gradient(THETA, 0.0, scale="sum", behaviour=mu, omega=omega))
  if invariant:
    np.testing.assert_allclose(diff, 0.0, atol=1e-5)
  else:
    assert np.abs(diff).max() > 0.05
