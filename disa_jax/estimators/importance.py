"""Stage 1: importance-sampling estimators of the partition function log Z(q).

For each prompt q, N trajectories o_i ~ p_T(.|q) from a proposal give log importance weights

    log w_i = log pi_ref(o_i|q) - log p_T(o_i|q) + beta * r~(q, o_i)            (w: paper eq. 7)

and the label

    log Z_IS(q) = logsumexp_i(log w_i) - log N                                    (paper eq. 8)

All functions take ``[P, N]`` arrays (P prompts, N samples) and an optional ``[P, N]`` validity mask for
ragged sample counts; invalid entries are ignored and N means the number of *valid* samples of the row.
They are pure and jitted.

Edge cases (defined behaviour, tested):
- A valid sample with log w = -inf (e.g. log pi_ref = -inf) contributes weight 0. It still counts in N.
- A row with valid samples whose weights are all 0: log Z_IS = log Z_GM = -inf, ESS = 0, CV^2 = NaN,
  max share = NaN.
- A row with no valid sample: every estimator returns NaN and ESS = 0. Stage 2 refuses NaN labels.
- N = 1: log Z_IS = log Z_GM = log w_1, ESS = 1, CV^2 = 0, max share = 1.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def _valid(log_w: Array, mask: Array | None) -> Array:
  if mask is None:
    return jnp.ones(log_w.shape, bool)
  return jnp.asarray(mask, bool)


def _masked_lse(x: Array, valid: Array) -> Array:
  """logsumexp over the last axis of the valid entries; -inf for rows with none or all -inf.

  Args:
    x: ``[P, N]`` float.
    valid: ``[P, N]`` bool.

  Returns:
    ``[P]`` float32.
  """
  x = jnp.where(valid, x.astype(jnp.float32), -jnp.inf)
  m = jnp.max(x, axis=-1)  # [P]
  m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
  s = jnp.sum(jnp.exp(x - m_safe[:, None]), axis=-1)  # exp(-inf) = 0 for masked entries
  return jnp.where(jnp.isfinite(m), m_safe + jnp.log(s), m)


@jax.jit
def log_importance_weights(logp_ref: Array,
                           logp_proposal: Array,
                           reward: Array,
                           beta: float | Array,
                           mask: Array | None = None) -> Array:
  """Log importance weights log w of paper eq. (7).

  Args:
    logp_ref: ``[P, N]`` log pi_ref(o_i | q), trajectory level (sum of token log-probs, or the
      length-normalised mean if the whole pipeline uses that scale).
    logp_proposal: ``[P, N]`` log p_T(o_i | q) on the same scale, of the distribution actually sampled.
    reward: ``[P, N]`` transformed reward r~(q, o_i) (see `reward_transforms`).
    beta: inverse temperature, scalar.
    mask: optional ``[P, N]`` bool validity mask.

  Returns:
    ``[P, N]`` float32 log w; -inf where ``mask`` is False.
  """
  lw = (jnp.asarray(logp_ref, jnp.float32) - jnp.asarray(logp_proposal, jnp.float32)
        + jnp.asarray(beta, jnp.float32) * jnp.asarray(reward, jnp.float32))
  return jnp.where(_valid(lw, mask), lw, -jnp.inf)


@jax.jit
def log_z_is(log_w: Array, mask: Array | None = None) -> Array:
  """The logsumexp IS estimate of log Z(q), paper eq. (8).

  log Z_IS = logsumexp over valid i of log w_i, minus log N_valid. Jensen-biased downward by about
  CV^2(w) / (2N) (Prop. 1), a bias that shrinks with N.

  Args:
    log_w: ``[P, N]`` log importance weights.
    mask: optional ``[P, N]`` bool validity mask.

  Returns:
    ``[P]`` float32; NaN for rows without a valid sample.
  """
  valid = _valid(log_w, mask)
  n = valid.sum(-1)  # [P]
  out = _masked_lse(log_w, valid) - jnp.log(jnp.maximum(n, 1).astype(jnp.float32))
  return jnp.where(n > 0, out, jnp.nan)


@jax.jit
def log_z_gm(log_w: Array, mask: Array | None = None) -> Array:
  """The geometric-mean aggregator (1/N) sum_i log w_i of App. C.2 (Prop. 2).

  Biased downward by about CV^2(w) / 2, a bias that does not shrink with N. Provided as the
  baseline the paper argues against.

  Args:
    log_w: ``[P, N]`` log importance weights.
    mask: optional ``[P, N]`` bool validity mask.

  Returns:
    ``[P]`` float32; -inf if any valid weight is 0; NaN for rows without a valid sample.
  """
  valid = _valid(log_w, mask)
  n = valid.sum(-1)
  total = jnp.sum(jnp.where(valid, log_w.astype(jnp.float32), 0.0), axis=-1)
  return jnp.where(n > 0, total / jnp.maximum(n, 1), jnp.nan)


@jax.jit
def effective_sample_size(log_w: Array, mask: Array | None = None) -> Array:
  """Kish effective sample size (sum w)^2 / sum w^2, computed in log space.

  Args:
    log_w: ``[P, N]`` log importance weights.
    mask: optional ``[P, N]`` bool validity mask.

  Returns:
    ``[P]`` float32 in [1, N_valid]; 0 for rows with no valid sample or all-zero weights.
  """
  valid = _valid(log_w, mask)
  lse1 = _masked_lse(log_w, valid)
  lse2 = _masked_lse(2.0 * log_w.astype(jnp.float32), valid)
  ess = jnp.exp(2.0 * lse1 - lse2)
  return jnp.where(jnp.isfinite(lse1), ess, 0.0)


@jax.jit
def cv_squared(log_w: Array, mask: Array | None = None) -> Array:
  """Squared coefficient of variation of the weights, Var(w) / mean(w)^2 (population variance).

  Equal to N / ESS - 1. This is the sample CV^2 that enters Props. 1-2.

  Args:
    log_w: ``[P, N]`` log importance weights.
    mask: optional ``[P, N]`` bool validity mask.

  Returns:
    ``[P]`` float32 >= 0; 0 for N = 1; NaN for rows with no valid sample or all-zero weights.
  """
  valid = _valid(log_w, mask)
  n = valid.sum(-1).astype(jnp.float32)
  lse1 = _masked_lse(log_w, valid)
  lse2 = _masked_lse(2.0 * log_w.astype(jnp.float32), valid)
  cv2 = jnp.maximum(n * jnp.exp(lse2 - 2.0 * lse1) - 1.0, 0.0)
  return jnp.where(jnp.isfinite(lse1) & (n > 0), cv2, jnp.nan)


@jax.jit
def max_weight_share(log_w: Array, mask: Array | None = None) -> Array:
  """The largest single normalised weight, max_i w_i / sum_i w_i.

  Args:
    log_w: ``[P, N]`` log importance weights.
    mask: optional ``[P, N]`` bool validity mask.

  Returns:
    ``[P]`` float32 in [1/N, 1]; NaN for rows with no valid sample or all-zero weights.
  """
  valid = _valid(log_w, mask)
  lse = _masked_lse(log_w, valid)
  mx = jnp.max(jnp.where(valid, log_w.astype(jnp.float32), -jnp.inf), axis=-1)
  return jnp.where(jnp.isfinite(lse), jnp.exp(mx - lse), jnp.nan)


@jax.jit
def stage1_statistics(log_w: Array, mask: Array | None = None) -> dict[str, Array]:
  """All per-prompt Stage 1 labels and diagnostics in one fused computation.

  Args:
    log_w: ``[P, N]`` log importance weights (`log_importance_weights`).
    mask: optional ``[P, N]`` bool validity mask.

  Returns:
    dict of ``[P]`` arrays: ``log_z_is`` (eq. 8), ``log_z_gm`` (App. C.2), ``ess``, ``cv2``,
    ``max_weight_share``, ``n_valid`` (int32).
  """
  valid = _valid(log_w, mask)
  return {
      "log_z_is": log_z_is(log_w, valid),
      "log_z_gm": log_z_gm(log_w, valid),
      "ess": effective_sample_size(log_w, valid),
      "cv2": cv_squared(log_w, valid),
      "max_weight_share": max_weight_share(log_w, valid),
      "n_valid": valid.sum(-1).astype(jnp.int32),
  }


def jensen_corrected_log_z(log_z: Array, cv2: Array, n_valid: Array) -> Array:
  """log Z_IS + CV^2 / (2N): removes Prop. 1's second-order Jensen bias (an optional label variant).

  Args:
    log_z: ``[P]`` log Z_IS labels.
    cv2: ``[P]`` sample CV^2 of the weights.
    n_valid: ``[P]`` number of valid samples.

  Returns:
    ``[P]`` corrected labels (unchanged where cv2 is NaN).
  """
  corr = jnp.where(jnp.isfinite(cv2), cv2, 0.0) / (2.0 * jnp.maximum(n_valid, 1))
  return log_z + corr


@jax.jit
def jackknife_log_z(log_w: Array, mask: Array | None = None) -> Array:
  """Jackknife bias-corrected log Z_IS: N L_N - (N - 1) mean_i L_{N-1}^{(-i)} (an optional label variant).

  L_N is the logsumexp label of eq. (8) over the N valid samples of a row and L_{N-1}^{(-i)} the same
  label with sample i left out. By Prop. 1, E[L_N] = log Z - c_1 / N - c_2 / N^2 + O(N^-3) with
  c_1 = CV^2(w) / 2; the jackknife combination cancels the 1/N term exactly, leaving a bias
  c_2 / (N (N - 1)) + O(N^-3) = O(1/N^2), whatever CV^2 is (it needs no plug-in estimate of CV^2, unlike
  `jensen_corrected_log_z`). Its variance is larger than that of L_N, notably for heavy-tailed weights
  where leaving out the one dominant sample moves L by a lot.

  Each leave-one-out logsumexp is computed directly over the other valid samples (an ``[P, N, N]``
  masked array, exact in float32 even when one weight dominates), not by subtracting w_i from the sum.

  Edge cases: rows with no valid sample give NaN; rows whose valid weights are all 0 give -inf; N = 1
  gives L_1 (no leave-one-out estimate exists); a row where leaving out some sample leaves only zero
  weights (a single nonzero weight) gives L_N, since the correction would be +inf.

  Args:
    log_w: ``[P, N]`` log importance weights (w of eq. 7).
    mask: optional ``[P, N]`` bool validity mask.

  Returns:
    ``[P]`` float32 labels.
  """
  valid = _valid(log_w, mask)
  x = log_w.astype(jnp.float32)
  n = valid.sum(-1)  # [P]
  nf = n.astype(jnp.float32)
  full = log_z_is(x, valid)  # [P]  L_N
  num = x.shape[-1]
  off_diag = ~jnp.eye(num, dtype=bool)  # [N_left_out, N_kept]
  keep = valid[:, None, :] & off_diag[None]  # [P, N_left_out, N_kept]
  x_loo = jnp.broadcast_to(x[:, None, :], keep.shape)  # [P, N_left_out, N_kept]
  lse_loo = _masked_lse(x_loo.reshape(-1, num), keep.reshape(-1, num)).reshape(keep.shape[:2])  # [P, N]
  loo = lse_loo - jnp.log(jnp.maximum(nf - 1.0, 1.0))[:, None]  # [P, N]  L_{N-1}^{(-i)}
  loo_ok = jnp.all(jnp.where(valid, jnp.isfinite(loo), True), axis=-1)  # [P]
  loo_mean = jnp.sum(jnp.where(valid, loo, 0.0), axis=-1) / jnp.maximum(nf, 1.0)  # [P]
  corrected = nf * full - (nf - 1.0) * loo_mean
  use = (n >= 2) & jnp.isfinite(full) & loo_ok
  return jnp.where(use, corrected, full)
