"""Tests for disa_jax.rl.losses: hand-computed values, invariants, App. C.5 and Prop. 3."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from disa_jax import codec
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


@pytest.mark.slow  # ~13 s: every loss eager and jitted
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
  m = jnp.array([[1, 1, 0], [0, 1, 1]])
  np.testing.assert_allclose(masked_mean_embedding(h, m, pooling="all_prompt_tokens"),
                             [[1.0, 2.0], [9.0, 10.0]])
  np.testing.assert_allclose(masked_mean_embedding(h, m), [[0.0, 1.0], [8.0, 9.0]])  # FlowRL


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


def test_app_c5_counterexample():
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


def test_group_zscore_ddof_single_sample_and_equal_groups():
  r = jnp.array([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0], [3.0, 9.0, 9.0, 9.0]])
  mask = jnp.array([[1, 1, 1, 1], [1, 1, 1, 1], [1, 0, 0, 0]], bool)
  pop = losses.group_zscore_advantages(r, mask, eps=0.0 + 1e-12)
  smp = losses.group_zscore_advantages(r, mask, eps=1e-6, ddof=1)
  # mean .25; population std sqrt(.1875), sample std sqrt(.25) = .5
  np.testing.assert_allclose(pop[0], (r[0] - 0.25) / math.sqrt(0.1875), rtol=1e-5)
  np.testing.assert_allclose(smp[0], (r[0] - 0.25) / (0.5 + 1e-6), rtol=1e-6)
  np.testing.assert_allclose(smp[0] / pop[0], math.sqrt(3 / 4), rtol=1e-5)  # sqrt((G-1)/G)
  np.testing.assert_allclose(pop[1], 0.0)  # all-equal group: std 0 -> 0 under both
  np.testing.assert_allclose(smp[1], 0.0)
  # one valid sample: population -> 0; sample follows veRL (mean 0, std 1): r / (1 + eps)
  np.testing.assert_allclose(pop[2], 0.0)
  np.testing.assert_allclose(smp[2], [3.0 / (1 + 1e-6), 0.0, 0.0, 0.0], rtol=1e-6)
  with pytest.raises(ValueError, match=r"ddof must be one of \(0, 1\), got 2"):
    losses.group_zscore_advantages(r, ddof=2)


def test_reward_transform_ddof_field_roundtrip_and_old_records():
  from disa_jax.estimators import RewardTransform
  t = RewardTransform(kind="group_zscore", ddof=1)
  r = jnp.array([[1.0, 0.0, 1.0, 1.0]])
  np.testing.assert_allclose(t.apply(r), losses.group_zscore_advantages(r, ddof=1), rtol=1e-6)
  assert codec.decode(RewardTransform, codec.encode(t), "reward_transform") == t
  old = {"kind": "group_zscore", "scale": 1.0, "shift": 0.0, "eps": 1e-6}  # written before ddof
  assert codec.decode(RewardTransform, old, "reward_transform").ddof == 0
  with pytest.raises(ValueError, match="mismatch"):
    t.check_matches(RewardTransform(kind="group_zscore"))
  with pytest.raises(ValueError, match=r"RewardTransform.ddof must be one of .* got 3"):
    RewardTransform(kind="group_zscore", ddof=3)


def test_grpo_token_mean_vs_seq_mean_and_loss_normalizer():
  # Row 0: one token, rho = 1, A = 1 -> l = -1. Row 1: three tokens, rho = 1, A = -2 -> l = 2 each.
  logp = jnp.zeros((2, 3))
  mask = jnp.array([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
  adv = jnp.array([1.0, -2.0])
  seq, m_seq = losses.grpo_loss(logp, logp, adv, mask)
  tok, m_tok = losses.grpo_loss(logp, logp, adv, mask, loss_agg="token-mean")
  np.testing.assert_allclose(seq, (-1.0 + 2.0) / 2)
  np.testing.assert_allclose(tok, (-1.0 + 3 * 2.0) / 4)
  np.testing.assert_allclose(m_tok["pg_loss"], tok)
  g_tok = jax.grad(lambda lp: losses.grpo_loss(lp, logp, adv, mask, loss_agg="token-mean")[0])(
      logp)
  np.testing.assert_allclose(g_tok, [[-0.25, 0, 0], [0.5, 0.5, 0.5]], rtol=1e-6)  # -A / 4 tokens
  assert float(losses.loss_normalizer("seq-mean-token-mean", mask)) == 2.0
  assert float(losses.loss_normalizer("token-mean", mask)) == 4.0
  with pytest.raises(ValueError, match=r"loss_agg must be one of .* got 'sum'"):
    losses.grpo_loss(logp, logp, adv, mask, loss_agg="sum")


@pytest.mark.parametrize("loss_agg", losses.AGG_KINDS)
@pytest.mark.slow
def test_micro_batches_recombined_with_loss_normalizer_equal_the_whole_batch(loss_agg):
  logp, old, ref, mask, adv = _batch(seed=5, b=6, t=5)
  mask = mask.at[4, 2:].set(0.0).at[5].set(0.0)  # uneven lengths and an empty row

  def loss(lp, rows):
    return losses.grpo_loss(lp[rows], old[rows], adv[rows], mask[rows], dual_clip=3.0,
                            ref_logp=ref[rows], kl_coef=0.1, loss_agg=loss_agg)[0]

  whole_l, whole_g = jax.value_and_grad(loss)(logp, slice(None))
  parts = [slice(0, 2), slice(2, 3), slice(3, 6)]
  ns = [float(losses.loss_normalizer(loss_agg, mask[p])) for p in parts]
  vg = [jax.value_and_grad(loss)(logp, p) for p in parts]
  comb_l = sum(n * l for n, (l, _) in zip(ns, vg)) / sum(ns)
  comb_g = sum(n * g for n, (_, g) in zip(ns, vg)) / sum(ns)
  np.testing.assert_allclose(comb_l, whole_l, rtol=1e-5)
  np.testing.assert_allclose(comb_g, whole_g, rtol=1e-5, atol=1e-7)
  # Weighting by rows is wrong for token-mean (and right for the row mean): the test can fail.
  rows = [float(losses.loss_normalizer("seq-mean-token-mean", mask[p])) for p in parts]
  by_rows = sum(n * l for n, (l, _) in zip(rows, vg)) / sum(rows)
  assert (abs(float(by_rows) - float(whole_l)) < 1e-6) == (loss_agg == "seq-mean-token-mean")


def test_grpo_dual_clip_is_verl_formula():
  # (rho, A): dual clip binds only for A < 0 and rho > c: veRL's where(A < 0, min(-cA, l), l).
  rho = jnp.array([4.0, 2.5, 5.0, 0.1])
  adv = jnp.array([-1.0, -1.0, 1.0, -2.0])
  old = jnp.zeros((4, 1))
  logp = jnp.log(rho)[:, None]
  mask = jnp.ones((4, 1))
  loss, m = losses.grpo_loss(logp, old, adv, mask, eps_low=0.2, eps_high=0.2, dual_clip=3.0)
  # -min(rho A, clip(rho) A): 4, 2.5, -1.2, 1.6; dual clip at -cA for A < 0: min(4, 3) = 3.
  np.testing.assert_allclose(loss, (3.0 + 2.5 - 1.2 + 1.6) / 4, rtol=1e-6)
  np.testing.assert_allclose(m["dual_clip_frac"], 0.25)
  g = jax.grad(lambda lp: losses.grpo_loss(lp, old, adv, mask, dual_clip=3.0)[0])(logp)
  # d/dlogp of l / 4: row 0 flat (dual clip), row 1 -A rho / 4, rows 2 and 3 clipped (flat).
  np.testing.assert_allclose(g[:, 0], [0.0, 2.5 / 4, 0.0, 0.0], atol=1e-7)


def test_kl_k3_clamp():
  logp = jnp.array([[0.0, 0.0]])
  ref = jnp.array([[1.0, 15.0]])  # d = 1 and 15: k3 = e - 2 and e^15 - 16
  np.testing.assert_allclose(losses.kl_penalty(logp, ref, "k3"), [[math.e - 2.0, 10.0]],
                             rtol=1e-6)
  np.testing.assert_allclose(losses.kl_penalty(logp, ref, "k3", clamp=None)[0, 1],
                             math.exp(15.0) - 16.0, rtol=1e-6)
  np.testing.assert_allclose(losses.kl_penalty(logp, ref, "k1", clamp=1.0), [[-1.0, -15.0]])
  g = jax.grad(lambda lp: losses.kl_penalty(lp, ref, "k3").sum())(logp)
  np.testing.assert_allclose(g, [[1.0 - math.e, 0.0]], rtol=1e-6)  # flat beyond the clamp
  with pytest.raises(ValueError, match=r"kl clamp must be None or > 0, got -1"):
    losses.kl_penalty(logp, ref, "k3", clamp=-1.0)


def test_gspo_log_ratio_cap_as_verl():
  old = jnp.zeros((1, 2))
  logp = jnp.full((1, 2), 12.0)  # mean log-ratio 12 > 10
  adv = jnp.array([-1.0])
  loss, _ = losses.gspo_loss(logp, old, adv, jnp.ones((1, 2)))
  np.testing.assert_allclose(loss, math.exp(10.0), rtol=1e-6)
  g = jax.grad(lambda lp: losses.gspo_loss(lp, old, adv, jnp.ones((1, 2)))[0])(logp)
  np.testing.assert_allclose(g, 0.0)


@pytest.mark.parametrize("mode,want", [
    ("one", [1.0, 1.0, 1.0]),
    ("ratio", [math.exp(2.5), math.exp(0.1), math.exp(-1.0)]),
    ("clipped_ratio", [10.0, math.exp(0.1), math.exp(-1.0)]),
    ("clamped_ratio", [1.28, math.exp(0.1), 0.8]),
])
def test_omega_modes_hand_values(mode, want):
  logp = jnp.full((3, 2), -1.0)
  old = jnp.array([[-2.5, -2.0], [-1.1, -1.0], [-0.5, -0.5]])  # log-ratios 2.5, 0.1, -1
  mask = jnp.ones((3, 2))
  omega, raw = losses.rollout_weights(logp, old, mask, mode=mode)
  np.testing.assert_allclose(omega, want, rtol=1e-6)
  if mode != "one":
    np.testing.assert_allclose(raw, np.exp([2.5, 0.1, -1.0]), rtol=1e-6)
  log_z = jnp.array([1.0, -2.0, 0.5])  # G = 1 and zero reward: residual = log_z
  loss_fn = lambda lp: losses.tb_loss(log_z, lp, logp, jnp.zeros(3), mask, beta=1.0,
                                      length_normalize=False, old_logp=old, omega_mode=mode)
  (loss, m), g = jax.value_and_grad(loss_fn, has_aux=True)(logp)
  np.testing.assert_allclose(loss, np.mean(np.array(want) * np.array([1.0, 4.0, 0.25])), rtol=1e-5)
  # omega is detached: d/dlogp_t = 2 omega_i R_i / 3 for every token of row i
  np.testing.assert_allclose(g, (2.0 / 3.0) * (np.array(want) * np.array(log_z))[:, None]
                             * np.ones((1, 2)), rtol=1e-5)
  clipped = {"one": 0, "ratio": 0, "clipped_ratio": 1, "clamped_ratio": 2}[mode]
  np.testing.assert_allclose(m["omega_clip_frac"], clipped / 3, rtol=1e-6)


def test_pooling_masks_and_embeddings():
  from disa_jax.rl.logz_head import pooling_mask
  m = jnp.array([[0, 1, 1, 1, 0], [1, 1, 0, 0, 0], [0, 0, 0, 0, 1]])  # left / right pad, 1 token
  np.testing.assert_array_equal(pooling_mask(m), [[0, 1, 1, 0, 0], [1, 0, 0, 0, 0], [0] * 5])
  np.testing.assert_array_equal(pooling_mask(m, "all_prompt_tokens"), m > 0)
  h = jnp.arange(3 * 5, dtype=jnp.float32).reshape(3, 5, 1)
  np.testing.assert_allclose(masked_mean_embedding(h, m)[:, 0], [1.5, 5.0, 0.0])
  np.testing.assert_allclose(masked_mean_embedding(h, m, pooling="all_prompt_tokens")[:, 0],
                             [2.0, 5.5, 14.0])
  with pytest.raises(ValueError, match=r"pooling must be one of .* got 'last'"):
    masked_mean_embedding(h, m, pooling="last")


def test_logz_head_dropout_and_init():
  emb = jax.random.normal(jax.random.key(0), (4096, 16))
  head = LogZHead(16, rngs=nnx.Rngs(0))
  base = head(emb)
  np.testing.assert_array_equal(head(emb), base)  # no key: deterministic (torch eval mode)
  k = jax.random.key(1)
  drop = jax.jit(lambda e, key: head(e, dropout_key=key))
  np.testing.assert_array_equal(drop(emb, k), drop(emb, k))
  assert not np.allclose(drop(emb, k), base)
  assert not np.allclose(drop(emb, k), drop(emb, jax.random.key(2)))
  # Inverted dropout keeps the mean of the pre-output activations: E[head] is close to base.
  assert abs(float(drop(emb, k).mean() - base.mean())) < 0.05 * float(base.std()) + 0.02
  no_drop = LogZHead(16, rngs=nnx.Rngs(0), dropout_rate=0.0)
  np.testing.assert_allclose(no_drop(emb, dropout_key=k), base, rtol=1e-6)
  bound = 1.0 / math.sqrt(16)
  for leaf in jax.tree.leaves(nnx.state(head.linears, nnx.Param)):
    assert 0.5 * bound < float(jnp.abs(leaf).max()) <= bound  # torch.nn.Linear's U(+-1/sqrt(D))
  shifted = LogZHead(16, rngs=nnx.Rngs(0), init_bias=3.0)
  np.testing.assert_allclose(shifted(emb), base + 3.0, rtol=1e-5, atol=1e-5)
  flax_head = LogZHead(16, rngs=nnx.Rngs(0), init="flax", init_bias=3.0)
  np.testing.assert_allclose(flax_head.out.bias[...], [3.0])
  with pytest.raises(ValueError, match=r"dropout_rate must be in \[0, 1\), got 1.0"):
    LogZHead(16, rngs=nnx.Rngs(0), dropout_rate=1.0)
