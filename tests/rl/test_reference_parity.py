"""Each Stage 3 objective against a NumPy transcription of its reference formula, loss and gradient.

The transcriptions below are written from reading the references (no reference code is imported or
needed): veRL ``verl/trainer/ppo/core_algos.py`` for GRPO (``compute_grpo_outcome_advantage``,
``compute_policy_loss_vanilla`` with the dual clip, ``agg_loss``, ``kl_penalty_forward``
'low_var_kl') and GSPO (``compute_policy_loss_gspo``); FlowRL's TB objective as its veRL recipe /
fork computes it (``compute_flowrl*``: token-mean log-probs, beta = 15, a detached trajectory
importance weight, ``torch.mean`` over rows); DISA's eq. (10) of the paper with a frozen anchor.
NumPy runs in float64; gradients are central finite differences of the transcription, with every
detached quantity (omega, GSPO's stop-gradient ratio) held at its unperturbed value. Each test
prints the max |delta| of the loss and of the gradients (run with ``-s`` to see them).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from disa_jax.rl import losses

P, G, T = 3, 4, 7
B = P * G
BETA = 15.0


def _verl_masked_mean(x, m, axis=None):
  return (np.where(m > 0, x, 0.0) * m).sum(axis=axis) / (m.sum(axis=axis) + 1e-8)


def _verl_masked_sum(x, m, axis=None):
  return (np.where(m > 0, x, 0.0) * m).sum(axis=axis)


def verl_grpo_advantage(scores: np.ndarray, group: np.ndarray, eps: float = 1e-6) -> np.ndarray:
  """compute_grpo_outcome_advantage: per group (r - mean) / (torch.std + eps); one-sample groups
  get mean 0 and std 1."""
  out = np.empty_like(scores)
  for g in np.unique(group):
    idx = group == g
    s = scores[idx]
    mean, std = (0.0, 1.0) if len(s) == 1 else (s.mean(), s.std(ddof=1))
    out[idx] = (s - mean) / (std + eps)
  return out


def verl_agg(loss_mat, mask, mode):
  """agg_loss for one data-parallel rank holding the whole mini-batch."""
  if mode == "token-mean":
    return _verl_masked_sum(loss_mat, mask) / mask.sum()
  seq_tok = mask.sum(-1)
  seq_losses = (loss_mat * mask).sum(-1) / (seq_tok + 1e-8)
  seq_mask = (seq_tok > 0).astype(np.float64)
  return _verl_masked_sum(seq_losses, seq_mask) / seq_mask.sum()


def verl_low_var_kl(logp, ref):
  kl = np.clip(ref - logp, -20, 20)
  return np.clip(np.exp(kl) - kl - 1, -10, 10)


def verl_grpo_loss(logp, old, adv_tok, mask, ref, *, clip_low, clip_high, clip_c, kl_coef, mode):
  """compute_policy_loss_vanilla + use_kl_loss (low_var_kl), both aggregated with ``mode``."""
  neg_kl = np.clip(logp - old, -20.0, 20.0)
  ratio = np.exp(neg_kl)
  pg1 = -adv_tok * ratio
  pg2 = -adv_tok * np.clip(ratio, 1 - clip_low, 1 + clip_high)
  clip1 = np.maximum(pg1, pg2)
  pg3 = -adv_tok * clip_c
  clip2 = np.minimum(pg3, clip1)
  pg_losses = np.where(adv_tok < 0, clip2, clip1)
  pg_loss = verl_agg(pg_losses, mask, mode)
  kl_loss = verl_agg(verl_low_var_kl(logp, ref), mask, mode)
  return pg_loss + kl_coef * kl_loss


def verl_gspo_loss(logp, logp_sg, old, adv_tok, mask, *, clip_low, clip_high):
  """compute_policy_loss_gspo: token ratio sg[s_i] * pi / sg[pi], seq-mean-token-mean."""
  seq_len = np.maximum(mask.sum(-1), 1)
  neg_kl_seq = ((logp_sg - old) * mask).sum(-1) / seq_len
  log_s = np.minimum(logp - logp_sg + neg_kl_seq[:, None], 10.0)
  s = np.exp(log_s)
  pg1 = -adv_tok * s
  pg2 = -adv_tok * np.clip(s, 1 - clip_low, 1 + clip_high)
  return verl_agg(np.maximum(pg1, pg2), mask, "seq-mean-token-mean")


def flowrl_tb_loss(logp, logp_sg, old, ref, log_z, adv_tok, mask, *, omega):
  """FlowRL's compute_flowrl*: token-mean log-probs, beta 15, detached weight, mean over rows."""
  avg_lp = _verl_masked_mean(logp, mask, axis=1)
  avg_ref = _verl_masked_mean(ref, mask, axis=1)
  seq_reward = _verl_masked_mean(adv_tok, mask, axis=1)
  delta = log_z + avg_lp - BETA * seq_reward - avg_ref
  w_raw = np.exp(_verl_masked_sum(logp_sg - old, mask, axis=1))
  w = {"ratio": w_raw,  # FlowRL HEAD compute_flowrl_objective / fork's compute_..._vanilla
       "clipped_ratio": np.minimum(w_raw, 10.0),  # veRL recipe compute_flowrl
       "clamped_ratio": np.clip(w_raw, 1 - 0.2, 1 + 0.28)}[omega]  # fork's compute_flowrl_clip
  return np.mean(w * delta**2)


def disa_eq10_loss(logp, logp_sg, old, ref, anchor, reward, mask, *, length_normalize, omega):
  """Paper eq. (10): (1/G) sum_i omega_i (g(q) + log pi - log pi_ref - beta r~)^2, mean over q."""
  red = (lambda x: _verl_masked_mean(x, mask, axis=1)) if length_normalize else (
      lambda x: (x * mask).sum(1))
  res = np.repeat(anchor, G) + red(logp) - red(ref) - BETA * reward
  w = np.ones(B) if omega == "one" else np.minimum(np.exp(((logp_sg - old) * mask).sum(1)), 10.0)
  return np.mean((w * res**2).reshape(P, G).mean(1))


def fd_grad(f, x, h=1e-6):
  """Central differences of scalar f at x (float64), entry by entry."""
  g = np.zeros_like(x)
  for idx in np.ndindex(x.shape):
    xp, xm = x.copy(), x.copy()
    xp[idx] += h
    xm[idx] -= h
    g[idx] = (f(xp) - f(xm)) / (2 * h)
  return g


def _inputs(seed=0):
  rng = np.random.default_rng(seed)
  mask = np.zeros((B, T), np.float32)
  lengths = rng.integers(2, T + 1, B)
  for i, n in enumerate(lengths):
    mask[i, :n] = 1.0
  logp = (-rng.uniform(0.2, 2.5, (B, T))).astype(np.float32)
  old = (logp + rng.normal(0.0, 0.25, (B, T))).astype(np.float32)
  ref = (logp + rng.normal(0.0, 1.5, (B, T))).astype(np.float32)
  reward = rng.integers(0, 2, (P, G)).astype(np.float32)
  reward[1] = 1.0  # an all-equal group
  return logp, old, ref, reward, mask


def _report(name, loss, loss_delta, grad_deltas):
  parts = ", ".join(f"{k} {d:.2e} (max|g| {s:.2e})" for k, (d, s) in grad_deltas.items())
  print(f"\n[parity] {name}: loss {loss:.4g}, max|d loss| {loss_delta:.2e}; max|d grad| {parts}")


def _check(name, got_loss, want_loss, grads):
  """grads: {label: (got, want)}; relative-to-scale float32 tolerances."""
  loss_delta = abs(float(got_loss) - float(want_loss))
  assert loss_delta <= 1e-5 * max(1.0, abs(float(want_loss))), (name, got_loss, want_loss)
  deltas = {}
  for label, (got, want) in grads.items():
    got = np.asarray(got, np.float64)
    deltas[label] = (float(np.max(np.abs(got - want))), float(np.abs(want).max()))
    assert np.abs(want).max() > 0, f"{name}: the reference gradient {label} is identically 0"
    np.testing.assert_allclose(got, want, atol=2e-5 * max(1.0, np.abs(want).max()), rtol=1e-4,
                               err_msg=f"{name} {label}")
  _report(name, float(want_loss), loss_delta, deltas)


def test_grpo_matches_verl_vanilla_with_dual_clip_kl_and_both_aggregations():
  logp, old, ref, reward, mask = _inputs(1)
  old = (logp + np.random.default_rng(7).normal(0.0, 0.8, logp.shape)).astype(np.float32)
  adv = np.asarray(losses.group_zscore_advantages(jnp.asarray(reward), ddof=1)).reshape(-1)
  adv_ref = verl_grpo_advantage(reward.reshape(-1).astype(np.float64), np.repeat(np.arange(P), G))
  np.testing.assert_allclose(adv, adv_ref, rtol=1e-5, atol=1e-6)
  settings = dict(clip_low=0.2, clip_high=0.2, clip_c=3.0, kl_coef=0.001)
  adv_tok = adv_ref[:, None] * mask
  for mode in ("token-mean", "seq-mean-token-mean"):
    def f(lp):
      return verl_grpo_loss(lp, old.astype(np.float64), adv_tok, mask, ref.astype(np.float64),
                            mode=mode, **settings)

    def ours(lp):
      return losses.grpo_loss(lp, jnp.asarray(old), jnp.asarray(adv), jnp.asarray(mask),
                              eps_low=0.2, eps_high=0.2, dual_clip=3.0, ref_logp=jnp.asarray(ref),
                              kl_coef=0.001, kl_kind="k3", kl_clamp=10.0, loss_agg=mode)

    lp64 = logp.astype(np.float64)
    (loss, m), g = jax.value_and_grad(ours, has_aux=True)(jnp.asarray(logp))
    assert float(m["dual_clip_frac"]) > 0 and float(m["clip_frac"]) > 0
    assert np.any(verl_low_var_kl(lp64, ref) == 10.0) and np.any(mask == 0)
    _check(f"GRPO {mode}", loss, f(lp64), {"dlogp": (np.asarray(g) * mask, fd_grad(f, lp64))})


def test_gspo_matches_verl_gspo():
  logp, old, _, reward, mask = _inputs(2)
  old[0] = logp[0] - 12.0  # a row whose mean log-ratio passes veRL's cap of 10
  adv = np.asarray(losses.group_zscore_advantages(jnp.asarray(reward), ddof=1)).reshape(-1)
  adv_tok = adv.astype(np.float64)[:, None] * mask
  lp64, old64 = logp.astype(np.float64), old.astype(np.float64)
  eps_low, eps_high = 0.05, 0.08

  def f(lp):
    return verl_gspo_loss(lp, lp64, old64, adv_tok, mask, clip_low=eps_low, clip_high=eps_high)

  def ours(lp):
    return losses.gspo_loss(lp, jnp.asarray(old), jnp.asarray(adv), jnp.asarray(mask),
                            eps_low=eps_low, eps_high=eps_high)

  (loss, m), g = jax.value_and_grad(ours, has_aux=True)(jnp.asarray(logp))
  assert 0 < float(m["clip_frac"]) < 1
  _check("GSPO", loss, f(lp64), {"dlogp": (np.asarray(g) * mask, fd_grad(f, lp64))})


@pytest.mark.parametrize("omega", ["ratio", "clipped_ratio", "clamped_ratio"])
def test_flowrl_matches_flowrl_tb_objective(omega):
  logp, old, ref, reward, mask = _inputs(3)
  old[0] = logp[0] - 1.0  # trajectory weights far above 10 and far below 0.8 occur
  old[1] = logp[1] + 1.0
  adv = np.asarray(losses.group_zscore_advantages(jnp.asarray(reward), ddof=1)).reshape(-1)
  adv_ref = verl_grpo_advantage(reward.reshape(-1).astype(np.float64), np.repeat(np.arange(P), G))
  np.testing.assert_allclose(adv, adv_ref, rtol=1e-5, atol=1e-6)
  log_z = np.random.default_rng(4).normal(0.0, 1.0, B).astype(np.float32)  # one per row, as FlowRL
  lp64, old64, ref64 = (x.astype(np.float64) for x in (logp, old, ref))
  adv_tok = adv_ref[:, None] * mask

  def f(lp, lz):
    return flowrl_tb_loss(lp, lp64, old64, ref64, lz, adv_tok, mask, omega=omega)

  def ours(lp, lz):
    return losses.flowrl_loss(lz, lp, jnp.asarray(ref), jnp.asarray(adv), jnp.asarray(mask),
                              beta=BETA, length_normalize=True, old_logp=jnp.asarray(old),
                              omega_mode=omega, omega_max=10.0, omega_eps_low=0.2,
                              omega_eps_high=0.28)

  (loss, m), (g_lp, g_lz) = jax.value_and_grad(ours, argnums=(0, 1), has_aux=True)(
      jnp.asarray(logp), jnp.asarray(log_z))
  assert (float(m["omega_clip_frac"]) > 0) == (omega != "ratio")
  lz64 = log_z.astype(np.float64)
  _check(f"FlowRL omega={omega}", loss, f(lp64, lz64),
         {"dlogp": (np.asarray(g_lp) * mask, fd_grad(lambda x: f(x, lz64), lp64)),
          "dlogZ": (g_lz, fd_grad(lambda z: f(lp64, z), lz64))})


@pytest.mark.parametrize("length_normalize,omega", [(False, "one"), (True, "clipped_ratio")])
def test_disa_matches_paper_eq10(length_normalize, omega):
  logp, old, ref, reward, mask = _inputs(4)
  r_t = np.asarray(losses.group_zscore_advantages(jnp.asarray(reward))).reshape(-1)
  anchor = np.random.default_rng(5).normal(0.0, 1.0, P).astype(np.float32)
  if not length_normalize:  # trajectory sums: keep the residuals O(1) for float32
    logp, old, ref = logp / T, old / T, ref / T
  lp64, old64, ref64 = (x.astype(np.float64) for x in (logp, old, ref))

  def f(lp):
    return disa_eq10_loss(lp, lp64, old64, ref64, anchor.astype(np.float64), r_t, mask,
                          length_normalize=length_normalize, omega=omega)

  def ours(lp, g):
    return losses.disa_loss(g, lp, jnp.asarray(ref), jnp.asarray(r_t), jnp.asarray(mask),
                            beta=BETA, length_normalize=length_normalize,
                            old_logp=jnp.asarray(old), omega_mode=omega, omega_max=10.0)

  (loss, _), (g_lp, g_anchor) = jax.value_and_grad(ours, argnums=(0, 1), has_aux=True)(
      jnp.asarray(logp), jnp.asarray(anchor))
  assert np.all(np.asarray(g_anchor) == 0.0)  # frozen anchor: no gradient reaches psi
  _check(f"DISA sum={not length_normalize} omega={omega}", loss, f(lp64),
         {"dlogp": (np.asarray(g_lp) * mask, fd_grad(f, lp64))})
