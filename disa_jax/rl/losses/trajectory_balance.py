"""Trajectory-balance losses (`disa_jax.rl.losses`): the TB residual and loss (eq. 5), DISA with
its frozen anchor (eq. 10), FlowRL with its co-trained head and rollout weights (eq. 6), and
VarGrad's batch estimate of log Z."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from disa_jax.rl.losses.common import (Array, Metrics, _check_rows, _check_tokens, _f32,
                                        _masked_row_max, _masked_row_std, expand_prompt_values,
                                        masked_row_mean, rollout_weights, valid_rows)
from disa_jax.scoring.logprobs import sequence_logprob



def tb_residual(log_z: Array,
                logp: Array,
                ref_logp: Array,
                reward: Array,
                mask: Array,
                *,
                beta: float,
                length_normalize: bool) -> Array:
  """Trajectory-balance residual of eqs. (5), (6) and (10) (eq:bg:tb, eq:bg:flowrl, eq:m:decrl).

  R_i = log Z(q) + log pi_theta(o_i|q) - log pi_ref(o_i|q) - beta * r~(q, o_i), with the two
  log-prob terms either trajectory sums (the paper's formal residual) or multiplied by 1/|o_i|
  (FlowRL's implementation: ``masked_mean`` of the token log-probs of pi_theta and pi_ref, the
  reward term not normalised; log Z must then be on the same length-normalised scale).

  Args:
    log_z: ``[P]`` per-prompt log Z (repeated over G = B // P rows) or ``[B]``.
    logp: ``[B, T]`` current-policy token log-probs.
    ref_logp: ``[B, T]`` reference token log-probs.
    reward: ``[B]`` transformed reward r~ per sequence.
    mask: ``[B, T]`` response mask.
    beta: inverse temperature beta > 0.
    length_normalize: 1/|o| on the log-prob terms if True, trajectory sums if False.

  Returns:
    ``[B]`` float32 residuals (0 on rows without response tokens).
  """
  _check_tokens(mask, logp=logp, ref_logp=ref_logp)
  batch = mask.shape[0]
  _check_rows(batch, reward=reward)
  lz = expand_prompt_values(log_z, batch)  # [B]
  res = (lz + sequence_logprob(logp, mask, length_normalize) -
         sequence_logprob(ref_logp, mask, length_normalize) - beta * _f32(reward))
  return jnp.where(valid_rows(mask), res, 0.0)


def tb_loss(log_z: Array,
            logp: Array,
            ref_logp: Array,
            reward: Array,
            mask: Array,
            *,
            beta: float,
            length_normalize: bool,
            old_logp: Array | None = None,
            omega_mode: str = "one",
            omega_max: float = 10.0,
            omega_eps_low: float = 0.2,
            omega_eps_high: float = 0.28,
            sample_weight: Array | None = None) -> tuple[Array, Metrics]:
  """Weighted squared TB residual, mean over valid rows: (1/B) sum_i omega_i R_i^2 (eq. 6 / 10).

  FlowRL's code takes ``torch.mean`` over the rows of a micro-batch and weights micro-batches by
  their row count, i.e. the same row mean (`loss_normalizer` 'seq-mean-token-mean').
  Gradients flow into ``log_z`` (FlowRL) unless the caller stops them (DISA, see `disa_loss`).

  Args:
    log_z, logp, ref_logp, reward, mask, beta, length_normalize: see `tb_residual`.
    old_logp: ``[B, T]`` rollout-time log-probs (needed for every omega mode but ``one``).
    omega_mode, omega_max, omega_eps_low, omega_eps_high: see `rollout_weights` (its ``mode``,
      ``max_weight``, ``eps_low``, ``eps_high``).
    sample_weight: optional fixed ``[B]`` nonnegative weights multiplied into omega (no gradient).

  Returns:
    (scalar loss, metrics): ``tb_residual_mean``/``_std``/``_abs_mean``, ``log_z_mean``/``_std``,
    ``omega_mean``/``_max``, ``omega_raw_mean``, ``omega_clip_frac`` (rows whose weight was
    clipped), ``logp_seq_mean``, ``ref_logp_seq_mean``, ``beta_reward_mean``.
  """
  _check_tokens(mask, old_logp=old_logp)
  if not beta > 0:
    raise ValueError(f"beta must be > 0, got {beta!r}")
  batch = mask.shape[0]
  _check_rows(batch, sample_weight=sample_weight)
  valid = valid_rows(mask)
  res = tb_residual(log_z, logp, ref_logp, reward, mask, beta=beta,
                    length_normalize=length_normalize)
  omega, omega_raw = rollout_weights(logp, old_logp, mask, mode=omega_mode, max_weight=omega_max,
                                     eps_low=omega_eps_low, eps_high=omega_eps_high)
  omega_clipped = omega != omega_raw
  if sample_weight is not None:
    omega = omega * jax.lax.stop_gradient(_f32(sample_weight))
  loss = masked_row_mean(omega * res**2, valid)
  res_d = jax.lax.stop_gradient(res)
  lz = jax.lax.stop_gradient(expand_prompt_values(log_z, batch))
  metrics = {
      "tb_residual_mean": masked_row_mean(res_d, valid),
      "tb_residual_std": _masked_row_std(res_d, valid),
      "tb_residual_abs_mean": masked_row_mean(jnp.abs(res_d), valid),
      "log_z_mean": masked_row_mean(lz, valid),
      "log_z_std": _masked_row_std(lz, valid),
      "omega_mean": masked_row_mean(omega, valid),
      "omega_max": _masked_row_max(omega, valid),
      "omega_raw_mean": masked_row_mean(omega_raw, valid),
      "omega_clip_frac": masked_row_mean(omega_clipped, valid),
      "logp_seq_mean": masked_row_mean(
          jax.lax.stop_gradient(sequence_logprob(logp, mask, length_normalize)), valid),
      "ref_logp_seq_mean": masked_row_mean(sequence_logprob(ref_logp, mask, length_normalize),
                                           valid),
      "beta_reward_mean": masked_row_mean(beta * _f32(reward), valid),
  }
  return loss, metrics


def disa_loss(anchor_log_z: Array, logp: Array, ref_logp: Array, reward: Array, mask: Array,
              **kwargs) -> tuple[Array, Metrics]:
  """DISA objective, eq. (10): the TB loss with a frozen anchor g_psi*(q) in place of log Z.

  The anchor values ``[P]`` pass through stop_gradient, so no gradient reaches psi whatever the
  caller differentiates. Keyword arguments are those of `tb_loss`.
  """
  return tb_loss(jax.lax.stop_gradient(_f32(anchor_log_z)), logp, ref_logp, reward, mask, **kwargs)


def flowrl_loss(head_log_z: Array, logp: Array, ref_logp: Array, reward: Array, mask: Array,
                **kwargs) -> tuple[Array, Metrics]:
  """FlowRL objective, eq. (6): the TB loss with a co-trained log Z_phi head.

  ``head_log_z`` is ``[P]`` (one value per prompt) or ``[B]`` (one per row, as FlowRL's code
  computes it: its head runs on every row's prompt states, so with dropout on, the G rows of a
  prompt get different values). Gradients reach both the policy (through ``logp``) and the head
  (through ``head_log_z``). Keyword arguments are those of `tb_loss`; FlowRL's settings are
  ``length_normalize=True``, ``beta=15``, the reward r~ = the GRPO advantage with ``ddof=1``, and
  an omega mode from `rollout_weights`.
  """
  return tb_loss(head_log_z, logp, ref_logp, reward, mask, **kwargs)


def batch_log_z(logp: Array,
                ref_logp: Array,
                reward: Array,
                mask: Array,
                *,
                group_size: int,
                beta: float,
                length_normalize: bool,
                leave_one_out: bool = False) -> Array:
  """The batch estimate of log Z of the VarGrad / log-variance loss, per row and without gradient.

  With t_i = beta * r~_i - log pi(o_i|q) + log pi_ref(o_i|q) (the two log-prob terms trajectory
  sums, or times 1/|o_i| with ``length_normalize``), the estimate for row i of prompt q's group
  is the mean of t over the group's valid rows,

      log Z^(q) = sg[(1/G_q) sum_{j in q} t_j],  or, leave-one-out,  sg[(1/(G_q - 1)) sum_{j != i} t_j].

  Put into the TB residual of eq. (5) it gives R_i = t-bar - t_i: the residuals of a group sum to
  0, so any per-prompt offset of log Z is removed exactly, and the loss (1/B) sum_i R_i^2 is the
  sum over groups of G_q times the (biased) sample variance of t: the log-variance loss of Richter
  et al. 2020 ("VarGrad: a low-variance gradient estimator for variational inference"), used for
  trajectory balance by TBA (Bartoldson et al. 2025, "Trajectory balance with asynchrony"). Its
  gradient (the estimate held fixed) equals the gradient of that variance, since sum_i R_i = 0.

  Args:
    logp: ``[B, T]`` token log-probs of the policy the estimate is taken at (pi_old in the trainer:
      the rollout policy, equal to pi_theta at the first update of a batch).
    ref_logp: ``[B, T]`` reference token log-probs.
    reward: ``[B]`` transformed reward r~.
    mask: ``[B, T]`` response mask; rows without response tokens are left out of every mean.
    group_size: G, rows per prompt (prompt-major: rows ``p*G : (p+1)*G``); B % G == 0.
    beta: inverse temperature > 0.
    length_normalize: the residual scale ('mean' if True, 'sum' if False).
    leave_one_out: each row's estimate leaves its own t out (needs >= 2 valid rows per group).

  Returns:
    ``[B]`` float32 log Z^ of each row's prompt (0 on invalid rows and groups without a valid row).
  """
  _check_tokens(mask, logp=logp, ref_logp=ref_logp)
  batch = mask.shape[0]
  _check_rows(batch, reward=reward)
  if group_size < 1 or batch % group_size:
    raise ValueError(f"group_size must divide the batch: B={batch}, group_size={group_size!r}")
  if not beta > 0:
    raise ValueError(f"beta must be > 0, got {beta!r}")
  valid = _f32(valid_rows(mask))
  t = (beta * _f32(reward) - sequence_logprob(logp, mask, length_normalize) +
       sequence_logprob(ref_logp, mask, length_normalize)) * valid  # [B]
  t_g, v_g = t.reshape(-1, group_size), valid.reshape(-1, group_size)  # [P, G]
  total, count = t_g.sum(-1, keepdims=True), v_g.sum(-1, keepdims=True)  # [P, 1]
  if leave_one_out:
    est = (total - t_g) / jnp.maximum(count - 1.0, 1.0)
  else:
    est = jnp.broadcast_to(total / jnp.maximum(count, 1.0), t_g.shape)
  return jax.lax.stop_gradient(jnp.where(v_g > 0, est, 0.0).reshape(-1))


def batch_centred_log_z(log_z: Array, logp: Array, ref_logp: Array, reward: Array, mask: Array, *,
                        beta: float, length_normalize: bool) -> Array:
  """A frozen log Z with the batch's mean residual removed: a constant baseline on top of it.

  With R_i the TB residual of eq. (5) at the given log Z and policy (`tb_residual`), the row's value

      log Z_c(q_i) = sg[ log Z(q_i) - (1/B_v) sum_{j valid} R_j ]

  makes the batch's residuals sum to 0 while keeping log Z's differences across prompts (issue 63:
  on-policy, the exact log Z puts E[R] = KL(pi || pi~) on every row, the worst constant baseline).
  Centring each prompt's group instead would be VarGrad exactly (its residual is t-bar - t_i for any
  per-prompt log Z: `batch_log_z`), so the centring here is over the whole batch.

  Args:
    log_z: ``[P]`` or ``[B]`` the frozen log Z (the anchor, or the exact value).
    logp: ``[B, T]`` token log-probs of the policy the baseline is taken at (pi_old: the rollout
      policy, pi_theta at the first update of a batch).
    ref_logp, reward, mask, beta, length_normalize: see `tb_residual`.

  Returns:
    ``[B]`` float32 centred log Z per row (0 on invalid rows).
  """
  valid = valid_rows(mask)
  res = tb_residual(log_z, logp, ref_logp, reward, mask, beta=beta,
                    length_normalize=length_normalize)  # [B], 0 on invalid rows
  mean = masked_row_mean(res, valid)
  lz = expand_prompt_values(_f32(log_z), mask.shape[0])
  return jax.lax.stop_gradient(jnp.where(valid, lz - mean, 0.0))


def vargrad_loss(batch_log_z_rows: Array, logp: Array, ref_logp: Array, reward: Array,
                 mask: Array, **kwargs) -> tuple[Array, Metrics]:
  """VarGrad: the TB loss of eq. (5) with the batch estimate of `batch_log_z` as log Z.

  ``batch_log_z_rows`` is ``[B]`` (one value per row: the leave-one-out estimate differs within a
  group) and passes through stop_gradient. Keyword arguments are those of `tb_loss` (scale, omega
  weights, sample weights).
  """
  return tb_loss(jax.lax.stop_gradient(_f32(batch_log_z_rows)), logp, ref_logp, reward, mask,
                 **kwargs)
