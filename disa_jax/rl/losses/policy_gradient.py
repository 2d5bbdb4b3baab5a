"""Policy-gradient losses (`disa_jax.rl.losses`): the KL penalty, importance weights of stale
rollouts, GRPO's clipped token surrogate (eqs. 1-3) with its KL-Cov variant, GSPO's sequence-level
surrogate, and the weighted log-likelihood of the SFT-style baselines."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from disa_jax.rl.losses.common import (Array, IS_CORRECTIONS, KL_KINDS, Metrics, _check_agg,
                                        _check_rows, _check_tokens, _f32, _masked_token_mean,
                                        aggregate, masked_row_mean, sequence_mean, sequence_sum,
                                        valid_rows)



def kl_penalty(logp: Array, ref_logp: Array, kind: str, *, clamp: float | None = 10.0) -> Array:
  """Per-token KL(pi_theta || pi_ref) estimators on samples from pi_theta: ``[B, T] -> [B, T]``.

  ``k1``: log pi_theta - log pi_ref. ``k3``: exp(d) - d - 1 with d = log pi_ref - log pi_theta
  clipped to [-20, 20] (nonnegative, unbiased), then clipped to [-clamp, clamp]: veRL's
  ``low_var_kl`` (``kl_penalty_forward`` in ``core_algos.py``) clamps k3 to [-10, 10], and the
  paper, which gives no KL term, is silent, so 10 is the default. Beyond the clamp the gradient is
  0.

  Args:
    logp, ref_logp: ``[B, T]`` token log-probs under pi_theta and pi_ref.
    kind: ``k1`` | ``k3``.
    clamp: bound on k3 (> 0), or None for no bound; not applied to k1 (veRL does not clamp it).

  Returns:
    ``[B, T]`` float32 per-token estimates.
  """
  if kind not in KL_KINDS:
    raise ValueError(f"kl kind must be one of {KL_KINDS}, got {kind!r}")
  if clamp is not None and not clamp > 0:
    raise ValueError(f"kl clamp must be None or > 0, got {clamp!r}")
  d = _f32(ref_logp) - _f32(logp)
  if kind == "k1":
    return -d
  d = jnp.clip(d, -20.0, 20.0)  # keeps exp finite; far outside any useful regime
  k3 = jnp.exp(d) - d - 1.0
  return k3 if clamp is None else jnp.clip(k3, -clamp, clamp)


def _ratio_metrics(log_ratio: Array, weights: Array, prefix: str) -> Metrics:
  """Mean / min / max of exp(log_ratio) over entries with weights > 0."""
  valid = weights > 0
  ratio = jnp.exp(jnp.clip(log_ratio, -80.0, 80.0))
  w = _f32(valid)
  return {
      f"{prefix}_mean": (ratio * w).sum() / jnp.maximum(w.sum(), 1.0),
      f"{prefix}_min": jnp.where(valid, ratio, jnp.inf).min(initial=jnp.inf),
      f"{prefix}_max": jnp.where(valid, ratio, -jnp.inf).max(initial=-jnp.inf),
  }


def behaviour_is_weights(old_logp: Array,
                         behaviour_logp: Array,
                         mask: Array,
                         on_policy: Array,
                         *,
                         mode: str,
                         cap: float,
                         level: str) -> tuple[Array, Metrics]:
  """Importance weights from the behaviour policy mu to pi_old, for stale or mismatched rollouts.

  The engine samples with mu (older weights at ``rollout.max_staleness`` k > 0, and its own
  numerics); the clipped surrogate is formed against pi_old, the policy before this step's updates.
  The correction multiplies each term by rho = pi_old / mu (detached), per token
  (rho_t = exp(log pi_old - log mu)) or per sequence with GSPO's geometric mean
  (rho_i = exp(mean_t (log pi_old - log mu))):

  - ``tis``: truncated importance sampling, min(rho, cap) (veRL's and TRL's TIS);
  - ``mis``: masked importance sampling, rho where rho <= cap and 0 elsewhere (the outlier is
    dropped instead of truncated);
  - ``none``: 1.

  Replayed rows (``on_policy`` 0) were not sampled by the engine: weight 1.

  Args:
    old_logp, behaviour_logp: ``[B, T]`` token log-probs of pi_old and of mu.
    mask: ``[B, T]`` response mask.
    on_policy: ``[B]`` 1 on the rows the engine sampled.
    mode: one of `IS_CORRECTIONS`.
    cap: C > 0, the truncation or masking threshold.
    level: 'token' (``[B, T]`` weights) or 'sequence' (``[B]``).

  Returns:
    (weights ``[B, T]`` or ``[B]``, detached; metrics ``is_weight_mean`` (after correction) and
    ``is_capped_frac`` (share of on-policy tokens or rows with rho > cap)).
  """
  if mode not in IS_CORRECTIONS:
    raise ValueError(f"is_correction must be one of {IS_CORRECTIONS}, got {mode!r}")
  if level not in ("token", "sequence"):
    raise ValueError(f"is level must be 'token' or 'sequence', got {level!r}")
  if not cap > 0:
    raise ValueError(f"is_cap must be > 0, got {cap!r}")
  _check_tokens(mask, old_logp=old_logp, behaviour_logp=behaviour_logp)
  _check_rows(mask.shape[0], on_policy=on_policy)
  diff = jnp.where(mask > 0, jax.lax.stop_gradient(_f32(old_logp)) - _f32(behaviour_logp), 0.0)
  on = _f32(on_policy) > 0
  if level == "token":
    rho = jnp.exp(jnp.clip(diff, -20.0, 20.0))
    sel = (mask > 0) & on[:, None]
  else:
    rho = jnp.exp(jnp.clip(sequence_mean(diff, mask), -20.0, 20.0))
    sel = valid_rows(mask) & on
  if mode == "none":
    w = jnp.ones_like(rho)
  elif mode == "tis":
    w = jnp.minimum(rho, cap)
  else:
    w = jnp.where(rho <= cap, rho, 0.0)
  w = jnp.where(sel, w, 1.0)
  n = jnp.maximum(_f32(sel).sum(), 1.0)
  return w, {"is_weight_mean": (w * sel).sum() / n,
             "is_capped_frac": (_f32(sel & (rho > cap))).sum() / n}


def mismatch_metrics(logp: Array, behaviour_logp: Array, mask: Array, on_policy: Array, *,
                     threshold: float) -> Metrics:
  """The train/inference mismatch: the trainer's and the engine's log-probs of the same tokens.

  Over the response tokens of the rows the engine sampled, d_t = log pi_trainer - log mu_engine
  (detached). At ``rollout.max_staleness`` 0 without temperature or truncation, the two are the
  same weights through two programs (numerics, dtypes, kernels); with stale rollouts the gap also
  holds the policy's change over k updates.

  Args:
    logp: ``[B, T]`` the trainer's token log-probs.
    behaviour_logp: ``[B, T]`` the engine's.
    mask: ``[B, T]`` response mask.
    on_policy: ``[B]`` 1 on the rows the engine sampled.
    threshold: nats of ``frac_over``.

  Returns:
    ``mismatch/logp_diff_mean`` (signed), ``mismatch/logp_abs_mean``, ``mismatch/logp_abs_max``,
    ``mismatch/frac_over`` (share of tokens with |d| > threshold); 0 without engine tokens.
  """
  _check_tokens(mask, logp=logp, behaviour_logp=behaviour_logp)
  sel = (mask > 0) & (_f32(on_policy) > 0)[:, None]
  d = jnp.where(sel, jax.lax.stop_gradient(_f32(logp)) - _f32(behaviour_logp), 0.0)
  n = jnp.maximum(_f32(sel).sum(), 1.0)
  return {"mismatch/logp_diff_mean": d.sum() / n,
          "mismatch/logp_abs_mean": jnp.abs(d).sum() / n,
          "mismatch/logp_abs_max": jnp.abs(d).max(),
          "mismatch/frac_over": _f32(jnp.abs(d) > threshold).sum() / n}


def _check_clip(eps_low: float, eps_high: float) -> None:
  if not (0 <= eps_low < 1 and eps_high >= 0):
    raise ValueError(f"need 0 <= eps_low < 1 and eps_high >= 0, got eps_low={eps_low!r}, "
                     f"eps_high={eps_high!r}")


def _clipped_surrogate(ratio: Array, adv: Array, eps_low: float, eps_high: float,
                       dual_clip: float | None) -> tuple[Array, Array, Array]:
  """-min(rho A, clip(rho) A), then veRL's dual clip for A < 0; elementwise.

  Returns:
    (loss, took_clip, dual_taken), same shape as ``ratio``.
  """
  loss_unclipped = -ratio * adv
  loss_clipped = -jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high) * adv
  loss = jnp.maximum(loss_unclipped, loss_clipped)  # = -min(rho A, clip(rho) A)
  took_clip = loss_clipped > loss_unclipped
  dual_taken = jnp.zeros_like(took_clip)
  if dual_clip is not None:
    bound = -dual_clip * adv  # > 0 for A < 0
    dual_taken = (adv < 0) & (loss > bound)
    loss = jnp.where(adv < 0, jnp.minimum(loss, bound), loss)
  return loss, took_clip, dual_taken


def grpo_loss(logp: Array,
              old_logp: Array,
              advantages: Array,
              mask: Array,
              *,
              eps_low: float = 0.2,
              eps_high: float = 0.2,
              dual_clip: float | None = None,
              ref_logp: Array | None = None,
              kl_coef: float = 0.0,
              kl_kind: str = "k3",
              kl_clamp: float | None = 10.0,
              loss_agg: str = "seq-mean-token-mean",
              kl_cov_ratio: float = 0.0,
              kl_cov_coef: float = 1.0,
              is_weights: Array | None = None) -> tuple[Array, Metrics]:
  """GRPO: token-level clipped surrogate of eq. (2) with group advantages of eq. (3).

  Per token rho_t = pi_theta / pi_old (eq. 1; log rho clipped to [-20, 20] as veRL does) and
  l_t = -min(rho_t A_i, clip(rho_t, 1 - eps_low, 1 + eps_high) A_i). With ``dual_clip`` c > 1,
  tokens with A_i < 0 are bounded as l_t = min(l_t, -c A_i), exactly veRL's dual clip
  (``compute_policy_loss_vanilla``: ``torch.where(A < 0, min(-A c, l), l)``, ``clip_ratio_c``
  3.0, always on there; the paper's eq. (2) has none, so the default here is off). With
  ``kl_coef`` > 0 the per-token KL estimate to pi_ref is added, l_t += kl_coef * kl_t (veRL's
  ``use_kl_loss``: the same aggregation applied to both terms). The loss aggregates l over the
  batch with ``loss_agg`` (see `aggregate`): the sequence-mean of token-means of eq. (2) by
  default, or veRL's ``token-mean``.

  Args:
    logp, old_logp: ``[B, T]`` current and rollout-time token log-probs.
    advantages: ``[B]`` per-sequence advantages (eq. 3, see `group_zscore_advantages`).
    mask: ``[B, T]`` response mask.
    eps_low, eps_high: clip range [1 - eps_low, 1 + eps_high] (veRL ``actor.yaml``: 0.2 / 0.2).
    dual_clip: None, or c > 1 for the dual clip on negative advantages (veRL: 3.0).
    ref_logp: ``[B, T]`` reference log-probs (required when kl_coef > 0).
    kl_coef: KL penalty coefficient (>= 0).
    kl_kind: ``k1`` | ``k3``.
    kl_clamp: bound on the k3 estimate, see `kl_penalty` (veRL: 10).
    loss_agg: ``seq-mean-token-mean`` (eq. 2) | ``token-mean`` (veRL's default); the caller
      recombines micro-batches with `loss_normalizer` of the same kind.
    kl_cov_ratio, kl_cov_coef: KL-Cov (`kl_cov_penalty`) added to the per-token loss; ratio 0 = off.
    is_weights: ``[B, T]`` detached behaviour -> pi_old weights multiplying the surrogate of each
      token (`behaviour_is_weights`, token level: TIS / MIS of stale rollouts); None = 1.

  Returns:
    (scalar loss, metrics): ``pg_loss`` (same aggregation), ``kl_cov_frac`` (with KL-Cov: the
    penalised share of tokens), ``clip_frac`` (tokens where the clipped
    branch is taken), ``clip_frac_low``/``_high``, ``dual_clip_frac``, ``ratio_mean``/``_min``/
    ``_max``, ``approx_kl_old`` (k3 to pi_old), ``kl_ref`` (when ref_logp given),
    ``advantage_mean``.
  """
  _check_tokens(mask, logp=logp, old_logp=old_logp, ref_logp=ref_logp)
  _check_rows(mask.shape[0], advantages=advantages)
  _check_clip(eps_low, eps_high)
  _check_agg(loss_agg)
  if dual_clip is not None and not dual_clip > 1:
    raise ValueError(f"dual_clip must be None or > 1, got {dual_clip!r}")
  if kl_coef < 0:
    raise ValueError(f"kl_coef must be >= 0, got {kl_coef!r}")
  if kl_coef > 0 and ref_logp is None:
    raise ValueError("kl_coef > 0 needs ref_logp, got None")
  valid = valid_rows(mask)
  tok = mask > 0
  adv = _f32(advantages)[:, None]  # [B] -> [B, 1], broadcast over tokens
  log_ratio = jnp.where(tok, _f32(logp) - _f32(old_logp), 0.0)  # [B, T]
  ratio = jnp.exp(jnp.clip(log_ratio, -20.0, 20.0))
  pg, took_clip, dual_taken = _clipped_surrogate(ratio, adv, eps_low, eps_high, dual_clip)
  if is_weights is not None:
    _check_tokens(mask, is_weights=is_weights)
    pg = pg * jax.lax.stop_gradient(_f32(is_weights))
  per_token = pg
  metrics: Metrics = {}
  if ref_logp is not None:
    kl = kl_penalty(logp, ref_logp, kl_kind, clamp=kl_clamp)
    metrics["kl_ref"] = _masked_token_mean(jax.lax.stop_gradient(kl), mask)
    if kl_coef > 0:
      per_token = per_token + kl_coef * kl
  if kl_cov_ratio > 0:
    penalty, chosen = kl_cov_penalty(logp, old_logp, advantages, mask, ratio=kl_cov_ratio,
                                     coef=kl_cov_coef)
    per_token = per_token + penalty
    metrics["kl_cov_frac"] = _masked_token_mean(chosen, mask)
  loss = aggregate(per_token, mask, loss_agg)
  sg_log_ratio = jax.lax.stop_gradient(log_ratio)
  metrics.update({
      "pg_loss": aggregate(jax.lax.stop_gradient(pg), mask, loss_agg),
      "clip_frac": _masked_token_mean(took_clip, mask),
      "clip_frac_low": _masked_token_mean(took_clip & (ratio < 1.0 - eps_low), mask),
      "clip_frac_high": _masked_token_mean(took_clip & (ratio > 1.0 + eps_high), mask),
      "dual_clip_frac": _masked_token_mean(dual_taken, mask),
      "approx_kl_old": _masked_token_mean(jnp.exp(-sg_log_ratio) + sg_log_ratio - 1.0, mask),
      "advantage_mean": masked_row_mean(_f32(advantages), valid),
  })
  metrics.update(_ratio_metrics(sg_log_ratio, _f32(tok), "ratio"))
  return loss, metrics


def kl_cov_penalty(logp: Array, old_logp: Array, advantages: Array, mask: Array, *,
                   ratio: float, coef: float) -> tuple[Array, Array]:
  """KL-Cov: a KL penalty on the tokens whose log-prob covaries most with their advantage.

  Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning Language
  Models" (Sec. 4, KL-Cov): the entropy of a softmax policy under policy gradient changes by minus
  the covariance between log pi(y) and its advantage, and a few high-covariance tokens drive the
  collapse. Per valid token, Cov_t = (A_t - mean A) (log pi_t - mean log pi) (means over the valid
  tokens, no gradient); the k = max(floor(ratio x n_valid), 1) tokens of largest Cov_t get
  coef |log pi_t - log pi_old,t|. The paper selects over the whole batch and pairs the penalty with
  the unclipped surrogate; here the selection is per micro-batch (the loss sees one) and the
  penalty is added to GRPO's clipped surrogate.

  Args:
    logp, old_logp: ``[B, T]`` current and rollout-time token log-probs.
    advantages: ``[B]`` per-sequence advantages (every token of a row shares its row's).
    mask: ``[B, T]`` response mask.
    ratio: share of the valid tokens penalised, in (0, 1) (the paper: 2e-3 at 7B, 2e-4 at 32B).
    coef: the penalty's coefficient (the paper: 1).

  Returns:
    (``[B, T]`` per-token penalty, 0 off the chosen tokens; ``[B, T]`` bool, the chosen tokens).
  """
  if not 0.0 < ratio < 1.0:
    raise ValueError(f"kl_cov ratio must be in (0, 1), got {ratio!r}")
  _check_tokens(mask, logp=logp, old_logp=old_logp)
  _check_rows(mask.shape[0], advantages=advantages)
  tok = mask > 0
  lp = _f32(logp)
  sg = jax.lax.stop_gradient(lp)
  adv = jnp.broadcast_to(_f32(advantages)[:, None], lp.shape)
  cov = (adv - _masked_token_mean(adv, mask)) * (sg - _masked_token_mean(sg, mask))
  cov = jnp.where(tok, cov, -jnp.inf).reshape(-1)
  k = jnp.maximum(jnp.floor(ratio * tok.sum()), 1.0).astype(jnp.int32)
  order = jnp.argsort(-cov)  # ties broken by position
  rank = jnp.zeros_like(order).at[order].set(jnp.arange(order.size, dtype=order.dtype))
  chosen = (rank < k).reshape(lp.shape) & tok
  penalty = jnp.where(chosen, coef * jnp.abs(lp - _f32(old_logp)), 0.0)
  return penalty, chosen


def sft_loss(logp: Array, weight: Array, mask: Array) -> tuple[Array, Metrics]:
  """Weighted negative log-likelihood of whole responses: mean over valid rows of
  w_i * (-sum_t log pi(o_it)) (trajectory sums, as the TB residual's log pi(o)).

  Args:
    logp: ``[B, T]`` token log-probs of the current policy.
    weight: ``[B]`` per-row weights (`ReplaySft`: 1 on replayed reward-1 rows, 0 elsewhere).
    mask: ``[B, T]`` response mask.

  Returns:
    (scalar loss, metrics): ``nll`` (the mean NLL of the weighted rows), ``weighted_rows``.
  """
  _check_tokens(mask, logp=logp)
  _check_rows(mask.shape[0], weight=weight)
  valid = valid_rows(mask)
  w = jnp.where(valid, _f32(weight), 0.0)
  nll = -sequence_sum(_f32(logp), mask)  # [B]
  loss = masked_row_mean(w * nll, valid)
  picked = w.sum()
  return loss, {"nll": jax.lax.stop_gradient((w * nll).sum() / jnp.maximum(picked, 1.0)),
                "weighted_rows": picked}


def gspo_loss(logp: Array,
              old_logp: Array,
              advantages: Array,
              mask: Array,
              *,
              eps_low: float = 3e-4,
              eps_high: float = 4e-4,
              is_weights: Array | None = None) -> tuple[Array, Metrics]:
  """GSPO: sequence-level clipped surrogate with the geometric-mean ratio.

  s_i = exp((1/|o_i|) sum_t (log pi_theta - log pi_old)) and
  l_i = -min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i), averaged over valid rows. This is
  veRL's ``compute_policy_loss_gspo`` with its forced ``seq-mean-token-mean``: there every token of
  row i carries the ratio sg[s_i] * pi_theta / sg[pi_theta], whose value is s_i and whose gradient
  with respect to token t is s_i, so the per-row token-mean has the value and the gradient of l_i
  here. As in veRL, log s_i is capped at 10 (no lower cap): beyond it the value stays exp(10) and
  the gradient is 0.

  Args:
    logp, old_logp: ``[B, T]`` current and rollout-time token log-probs.
    advantages: ``[B]`` group-normalised advantages (eq. 3).
    mask: ``[B, T]`` response mask.
    eps_low, eps_high: clip range (GSPO's defaults 3e-4 and 4e-4).
    is_weights: ``[B]`` detached behaviour -> pi_old weights of each sequence
      (`behaviour_is_weights`, sequence level); None = 1.

  Returns:
    (scalar loss, metrics): ``pg_loss``, ``clip_frac`` (sequences where the clipped branch is
    taken), ``clip_frac_low``/``_high``, ``seq_ratio_mean``/``_min``/``_max``, ``approx_kl_old``,
    ``advantage_mean``.
  """
  _check_tokens(mask, logp=logp, old_logp=old_logp)
  _check_rows(mask.shape[0], advantages=advantages)
  _check_clip(eps_low, eps_high)
  valid = valid_rows(mask)
  adv = _f32(advantages)
  log_s = sequence_mean(_f32(logp) - _f32(old_logp), mask)  # [B]
  s = jnp.exp(jnp.minimum(log_s, 10.0))
  per_seq, took_clip, _ = _clipped_surrogate(s, adv, eps_low, eps_high, None)
  if is_weights is not None:
    _check_rows(mask.shape[0], is_weights=is_weights)
    per_seq = per_seq * jax.lax.stop_gradient(_f32(is_weights))
  loss = masked_row_mean(per_seq, valid)
  sg_log_ratio = jax.lax.stop_gradient(jnp.where(mask > 0, _f32(logp) - _f32(old_logp), 0.0))
  metrics = {
      "pg_loss": jax.lax.stop_gradient(loss),
      "clip_frac": masked_row_mean(took_clip, valid),
      "clip_frac_low": masked_row_mean(took_clip & (s < 1.0 - eps_low), valid),
      "clip_frac_high": masked_row_mean(took_clip & (s > 1.0 + eps_high), valid),
      "approx_kl_old": _masked_token_mean(jnp.exp(-sg_log_ratio) + sg_log_ratio - 1.0, mask),
      "advantage_mean": masked_row_mean(adv, valid),
  }
  metrics.update(_ratio_metrics(jax.lax.stop_gradient(log_s), _f32(valid), "seq_ratio"))
  return loss, metrics
