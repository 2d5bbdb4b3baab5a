"""Tests for disa_jax.rl.losses: hand-computed values, invariants, App. B.5 and Prop. 3."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from disa_jax.rl import losses
from disa_jax.rl.logz_head import LogZHead, masked_mean_embedding


def _batch(seed=0, b=4, t=5):
  rng = np.random.default_rng(seed)
  logp = -rng.uniform(0.1, 2.0, (b, t)).astype(np.float32)
  old = logp + rng.normal(0, 0.3, (b, t)).astype(np.float32)
  ref = logp + rng.normal(0, 0.5, (b, t)).astype(np.float32)
  mask = np.ones((b, t), np.float32)
  mask[0, 3:] = 0
  mask[2, 1:] = 0
  reward = rng.normal(size=b).astype(np.float32)
  return tuple(jnp.asarray(x) for x in (logp, old, ref, mask, reward))


def test_tb_residual_hand_values():
  logp = jnp.array([[-1.0, -2.0, 9.0], [-0.5, -0.5, -0.5]])
  ref = jnp.array([[-1.5, -1.0, 7.0], [-1.0, -1.0, -1.0]])
  mask = jnp.array([[1, 1, 0], [1, 1, 1]], jnp.float32)
  reward = jnp.array([1.0, 0.0])
  log_z = jnp.array([0.25])  # one prompt, G = 2
  r_sum = losses.tb_residual(log_z, logp, ref, reward, mask, beta=2.0, length_normalize=False)
  # row 0: 0.25 + (-3) - (-2.5) - 2 = -2.25; row 1: 0.25 - 1.5 + 3 = 1.75
  np.testing.assert_allclose(r_sum, [-2.25, 1.75], rtol=1e-6)
  r_mean = losses.tb_residual(log_z, logp, ref, reward, mask, beta=2.0, length_normalize=True)
  # row 0: 0.25 - 1.5 + 1.25 - 2 = -2.0; row 1: 0.25 - 0.5 + 1.0 = 0.75
  np.testing.assert_allclose(r_mean, [-2.0, 0.75], rtol=1e-6)
  loss, m = losses.disa_loss(log_z, logp, ref, reward, mask, beta=2.0, length_normalize=False)
  np.testing.assert_allclose(loss, (2.25**2 + 1.75**2) / 2, rtol=1e-6)
  np.testing.assert_allclose(m["tb_residual_mean"], (-2.25 + 1.75) / 2, rtol=1e-6)
  np.testing.assert_allclose(m["tb_residual_std"], 2.0, rtol=1e-6)
  np.testing.assert_allclose(m["log_z_mean"], 0.25, rtol=1e-6)


def test_clipped_ratio_omega_hand_values():
  logp = jnp.array([[-1.0, -1.0], [-1.0, -1.0]])
  old = jnp.array([[-2.5, -2.0], [-1.1, -1.0]])  # log-ratios 2.5 and 0.1
  ref = logp
  mask = jnp.ones((2, 2))
  reward = jnp.zeros(2)
  log_z = jnp.array([1.0, -2.0])  # G = 1: residual = log_z
  loss, m = losses.tb_loss(log_z, logp, ref, reward, mask, beta=1.0, length_normalize=False,
                           old_logp=old, omega_mode="clipped_ratio", omega_max=10.0)
  w0 = min(math.exp(2.5), 10.0)
  w1 = math.exp(0.1)
  np.testing.assert_allclose(loss, (w0 * 1.0 + w1 * 4.0) / 2, rtol=1e-5)
  np.testing.assert_allclose(m["omega_clip_frac"], 0.5)
  np.testing.assert_allclose(m["omega_max"], 10.0)
  np.testing.assert_allclose(m["omega_raw_mean"], (math.exp(2.5) + w1) / 2, rtol=1e-5)


def test_grpo_hand_values_clip_dual_and_kl():
  # Three one-token sequences: ratio 1.5 with A=+1 (clipped high), ratio 0.5 with A=-1 (clipped
  # low), ratio 4 with A=-1 (dual clip at c=3).
  old = jnp.zeros((3, 1))
  logp = jnp.log(jnp.array([[1.5], [0.5], [4.0]]))
  adv = jnp.array([1.0, -1.0, -1.0])
  mask = jnp.ones((3, 1))
  loss, m = losses.grpo_loss(logp, old, adv, mask, eps_low=0.2, eps_high=0.28)
  # per token: -min(1.5, 1.28) = -1.28; -min(-0.5, -0.8) = 0.8; -min(-4, -1.2) = 4
  np.testing.assert_allclose(loss, (-1.28 + 0.8 + 4.0) / 3, rtol=1e-5)
  np.testing.assert_allclose(m["clip_frac"], 2 / 3, rtol=1e-6)
  np.testing.assert_allclose(m["clip_frac_high"], 1 / 3, rtol=1e-6)
  np.testing.assert_allclose(m["clip_frac_low"], 1 / 3, rtol=1e-6)
  np.testing.assert_allclose(m["ratio_max"], 4.0, rtol=1e-5)
  np.testing.assert_allclose(m["ratio_min"], 0.5, rtol=1e-5)
  loss_d, m_d = losses.grpo_loss(logp, old, adv, mask, eps_low=0.2, eps_high=0.28, dual_clip=3.0)
  np.testing.assert_allclose(loss_d, (-1.28 + 0.8 + 3.0) / 3, rtol=1e-5)
  np.testing.assert_allclose(m_d["dual_clip_frac"], 1 / 3, rtol=1e-6)
  # KL: d = ref - logp; k1 = -d, k3 = e^d - d - 1.
  ref = logp + jnp.array([[0.5], [0.0], [-1.0]])
  for kind, vals in (("k1", [-0.5, 0.0, 1.0]),
                     ("k3", [math.exp(0.5) - 1.5, 0.0, math.exp(-1.0)])):
    loss_k, m_k = losses.grpo_loss(logp, old, adv, mask, eps_low=0.2, eps_high=0.28,
                                   ref_logp=ref, kl_coef=0.1, kl_kind=kind)
    np.testing.assert_allclose(loss_k, loss + 0.1 * np.mean(vals), rtol=1e-5)
    np.testing.assert_allclose(m_k["kl_ref"], np.mean(vals), rtol=1e-5, atol=1e-7)


def test_grpo_token_mean_within_sequence():
  old = jnp.zeros((1, 3))
  logp = jnp.zeros((1, 3))
  mask = jnp.array([[1.0, 1.0, 0.0]])
  loss, _ = losses.grpo_loss(logp, old, jnp.array([2.0]), mask)
  np.testing.assert_allclose(loss, -2.0)
  # Gradient of the unclipped surrogate: d/dlogp_t of -(1/T) * rho_t * A = -A/T at rho = 1.
  g = jax.grad(lambda lp: losses.grpo_loss(lp, old, jnp.array([2.0]), mask)[0])(logp)
  np.testing.assert_allclose(g, [[-1.0, -1.0, 0.0]], rtol=1e-6)


def test_gspo_hand_values():
  old = jnp.zeros((2, 2))
  # geometric-mean log-ratios: 1e-4 (inside the clip range) and 1e-3 (clipped at 1 + 4e-4)
  logp = jnp.array([[2e-4, 0.0], [1e-3, 1e-3]])
  adv = jnp.array([1.0, 1.0])
  mask = jnp.ones((2, 2))
  loss, m = losses.gspo_loss(logp, old, adv, mask)
  np.testing.assert_allclose(loss, -(math.exp(1e-4) + 1.0004) / 2, rtol=1e-6)
  np.testing.assert_allclose(m["clip_frac"], 0.5)
  np.testing.assert_allclose(m["clip_frac_high"], 0.5)
  g = jax.grad(lambda lp: losses.gspo_loss(lp, old, adv, mask)[0])(logp)
  # row 0: -(1/2) * s0 * (1/2) per token; row 1 clipped: zero gradient
  np.testing.assert_allclose(g[0], [-0.25 * math.exp(1e-4)] * 2, rtol=1e-5)
  np.testing.assert_allclose(g[1], [0.0, 0.0], atol=0)


def _all_losses(logp, old, ref, mask, reward, log_z):
  return {
      "disa": losses.disa_loss(log_z, logp, ref, reward, mask, beta=3.0, length_normalize=True,
                               old_logp=old, omega_mode="clipped_ratio", omega_max=2.0),
      "flowrl": losses.flowrl_loss(log_z, logp, ref, reward, mask, beta=3.0,
                                   length_normalize=False),
      "grpo": losses.grpo_loss(logp, old, reward, mask, eps_low=0.1, eps_high=0.2, dual_clip=3.0,
                               ref_logp=ref, kl_coef=0.05, kl_kind="k3"),
      "gspo": losses.gspo_loss(logp, old, reward, mask, eps_low=0.05, eps_high=0.1),
  }


def test_jit_matches_eager():
  logp, old, ref, mask, reward = _batch()
  log_z = jnp.array([0.3, -0.7])
  eager = _all_losses(logp, old, ref, mask, reward, log_z)
  jitted = jax.jit(_all_losses)(logp, old, ref, mask, reward, log_z)
  for name in eager:
    np.testing.assert_allclose(jitted[name][0], eager[name][0], rtol=1e-5, err_msg=name)
    for k in eager[name][1]:
      np.testing.assert_allclose(jitted[name][1][k], eager[name][1][k], rtol=1e-5, atol=1e-6,
                                 err_msg=f"{name}/{k}")


def test_masked_equals_sliced():
  logp, old, ref, mask, reward = _batch(seed=1)
  mask = jnp.ones_like(mask)
  log_z = jnp.array([0.3, -0.7])
  base = _all_losses(logp, old, ref, mask, reward, log_z)
  # Pad 3 extra token columns with garbage, and 2 extra fully masked rows (one extra prompt).
  pad = lambda x, v: jnp.pad(x, ((0, 2), (0, 3)), constant_values=v)
  padded = _all_losses(pad(logp, -7.0), pad(old, 3.0), pad(ref, 11.0), pad(mask, 0.0),
                       jnp.pad(reward, (0, 2), constant_values=5.0), jnp.append(log_z, 9.0))
  for name in base:
    np.testing.assert_allclose(padded[name][0], base[name][0], rtol=1e-5, err_msg=name)
    for k in base[name][1]:
      np.testing.assert_allclose(padded[name][1][k], base[name][1][k], rtol=1e-5, atol=1e-6,
                                 err_msg=f"{name}/{k}")


def test_anchor_gradient_zero_under_disa_and_head_gradient_nonzero_under_flowrl():
  logp, old, ref, mask, reward = _batch(seed=2)
  emb = jax.random.normal(jax.random.key(0), (2, 16))
  head = LogZHead(16, rngs=nnx.Rngs(0))

  def disa_obj(log_z, lp):
    return losses.disa_loss(log_z, lp, ref, reward, mask, beta=15.0, length_normalize=True)[0]

  g_z, g_lp = jax.grad(disa_obj, argnums=(0, 1))(jnp.array([0.5, -0.5]), logp)
  assert np.all(np.asarray(g_z) == 0.0)
  assert np.abs(np.asarray(g_lp)).sum() > 0

  def flowrl_obj(h):
    return losses.flowrl_loss(h(emb), logp, ref, reward, mask, beta=15.0,
                              length_normalize=True)[0]

  grads = nnx.grad(flowrl_obj)(head)
  leaves = jax.tree.leaves(grads)
  assert leaves and all(np.all(np.isfinite(x)) for x in leaves)
  assert sum(float(jnp.abs(x).sum()) for x in leaves) > 1e-3
  # An anchor produced by the same head under DISA gets no gradient either.
  grads_disa = nnx.grad(lambda h: losses.disa_loss(h(emb), logp, ref, reward, mask, beta=15.0,
                                                   length_normalize=True)[0])(head)
  assert all(np.all(np.asarray(x) == 0.0) for x in jax.tree.leaves(grads_disa))


def test_masked_mean_embedding():
  h = jnp.arange(2 * 3 * 2, dtype=jnp.float32).reshape(2, 3, 2)
  m = jnp.array([[1, 1, 0], [0, 0, 1]])
  np.testing.assert_allclose(masked_mean_embedding(h, m), [[1.0, 2.0], [10.0, 11.0]])


def _counterexample_loss(p, eta=-2.0):
  """On-policy L(p) = sum_o pi_p(o) R(o)^2 as a weighted DISA loss over the two outcomes."""
  log_ref = jnp.log(jnp.array([[0.5], [0.5]]))
  reward = jnp.array([math.log(2.0), 0.0])
  logp = jnp.log(jnp.array([[p], [1 - p]]))
  anchor = jnp.array([math.log(1.5) + eta])  # log Z + eta, one prompt with G = 2
  # mean over 2 rows with weights 2 * pi_p(o) = sum_o pi_p(o) R(o)^2
  loss, _ = losses.disa_loss(anchor, logp, log_ref, reward, jnp.ones((2, 1)), beta=1.0,
                             length_normalize=False,
                             sample_weight=2.0 * jnp.array([p, 1 - p]))
  return float(loss)


def test_app_b5_counterexample():
  assert _counterexample_loss(2 / 3) == pytest.approx(4.0, abs=1e-5)
  l09 = _counterexample_loss(0.9)
  assert l09 == pytest.approx(3.63, abs=5e-3)
  assert l09 < 4.0
  # The decomposition L(p) = E[(log pi - log pi~)^2] + 2 eta KL(pi || pi~) + eta^2.
  p = 0.9
  d = np.array([math.log(p / (2 / 3)), math.log((1 - p) / (1 / 3))])
  w = np.array([p, 1 - p])
  assert l09 == pytest.approx(float(w @ d**2 + 2 * -2.0 * (w @ d) + 4.0), abs=1e-4)
  # With the exact partition function (eta = 0) the target is the minimiser.
  assert _counterexample_loss(2 / 3, eta=0.0) == pytest.approx(0.0, abs=1e-10)
  assert _counterexample_loss(0.9, eta=0.0) > 0.0


def test_prop3_exact_log_z_drives_kl_to_zero():
  """DISA with exact log Z on an enumerable problem: tabular softmax policy, on-policy samples."""
  num_prompts, num_outcomes, group, beta = 3, 6, 64, 1.0
  key = jax.random.key(0)
  k_ref, k_r = jax.random.split(key)
  log_ref = jax.nn.log_softmax(jax.random.normal(k_ref, (num_prompts, num_outcomes)))
  reward = jax.random.bernoulli(k_r, 0.4, (num_prompts, num_outcomes)).astype(jnp.float32)
  log_target_unnorm = log_ref + beta * reward
  log_z = jax.nn.logsumexp(log_target_unnorm, axis=-1)  # exact [P]
  log_target = log_target_unnorm - log_z[:, None]

  def kl(theta):
    lp = jax.nn.log_softmax(theta)
    return (jnp.exp(lp) * (lp - log_target)).sum(-1).mean()

  def loss_fn(theta, outcomes):
    lp_all = jax.nn.log_softmax(theta)  # [P, K]
    rows = jnp.repeat(jnp.arange(num_prompts), group)  # [P * G]
    o = outcomes.reshape(-1)  # [P, G] -> [P * G]
    logp = lp_all[rows, o][:, None]  # one-token "sequences": [B, 1]
    ref = log_ref[rows, o][:, None]
    r = reward[rows, o]
    return losses.disa_loss(log_z, logp, ref, r, jnp.ones_like(logp), beta=beta,
                            length_normalize=False)[0]

  opt = optax.adam(0.05)

  @jax.jit
  def step(theta, opt_state, key):
    outcomes = jax.random.categorical(key, theta, shape=(group, num_prompts)).T  # [P, G]
    g = jax.grad(loss_fn)(theta, outcomes)
    updates, opt_state = opt.update(g, opt_state)
    return optax.apply_updates(theta, updates), opt_state

  theta = log_ref + 1.5 * jax.random.normal(jax.random.key(1), log_ref.shape)  # start off-target
  opt_state = opt.init(theta)
  kl0 = float(kl(theta))
  for k in jax.random.split(jax.random.key(2), 400):
    theta, opt_state = step(theta, opt_state, k)
  kl_end = float(kl(theta))
  assert kl0 > 0.3
  assert kl_end < 0.01 * kl0, (kl0, kl_end)


def test_errors_name_field_and_value():
  logp, old, ref, mask, reward = _batch()
  with pytest.raises(ValueError, match=r"log_z has P=3 .* B=4"):
    losses.disa_loss(jnp.zeros(3), logp, ref, reward, mask, beta=1.0, length_normalize=True)
  with pytest.raises(ValueError, match=r"beta must be > 0, got -1"):
    losses.disa_loss(jnp.zeros(2), logp, ref, reward, mask, beta=-1.0, length_normalize=True)
  with pytest.raises(ValueError, match=r"omega mode .* got 'bogus'"):
    losses.disa_loss(jnp.zeros(2), logp, ref, reward, mask, beta=1.0, length_normalize=True,
                     omega_mode="bogus")
  with pytest.raises(ValueError, match=r"reward must have shape"):
    losses.disa_loss(jnp.zeros(2), logp, ref, reward[:3], mask, beta=1.0, length_normalize=True)
  with pytest.raises(ValueError, match=r"dual_clip .* got 0.5"):
    losses.grpo_loss(logp, old, reward, mask, dual_clip=0.5)
  with pytest.raises(ValueError, match=r"kl kind .* got 'k2'"):
    losses.grpo_loss(logp, old, reward, mask, ref_logp=ref, kl_coef=0.1, kl_kind="k2")
  with pytest.raises(ValueError, match=r"old_logp must have"):
    losses.grpo_loss(logp, old[:, :2], reward, mask)


def test_group_zscore_advantages():
  r = jnp.array([[1.0, 0.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
  a = losses.group_zscore_advantages(r)
  np.testing.assert_allclose(a[0], [1, -1, 1, -1], rtol=1e-5)
  np.testing.assert_allclose(a[1], 0.0)
