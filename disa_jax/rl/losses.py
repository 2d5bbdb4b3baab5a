"""Stage 3 policy losses: DISA, FlowRL, VarGrad, GRPO and GSPO as pure jittable functions.

All four methods share one convention for a batch of B = P * G sampled responses (P prompts, G
responses each, prompt-major so that rows ``p*G : (p+1)*G`` belong to prompt p):

- ``logp``, ``old_logp``, ``ref_logp``: ``[B, T]`` per-token log-probs of the sampled response
  tokens under the current policy pi_theta, the rollout policy pi_old (recorded at rollout time)
  and the frozen reference pi_ref. Values outside ``mask`` are ignored (any finite value).
- ``mask``: ``[B, T]`` 1 on response tokens, 0 on prompt and padding tokens. A row with no response
  token is an invalid (padding) sample: it contributes nothing to the loss or to the metrics.
- per-sequence scalars (transformed rewards r~, advantages): ``[B]``.
- per-prompt scalars (log Z): ``[P]`` with B divisible by P; they are repeated over the G rows of
  each prompt (``G = B // P``; a ``[B]`` array is the special case G = 1).

Aggregation and micro-batching. DISA, FlowRL and GSPO average per-sequence terms over the valid
rows; GRPO averages over rows (``loss_agg='seq-mean-token-mean'``, eq. 2) or over all valid tokens
of the batch (``loss_agg='token-mean'``, veRL's default). A batch split into micro-batches is
recovered exactly by weighting each micro-batch's loss (and gradient) by its normaliser and dividing
by the sum of the normalisers: `loss_normalizer` gives it (valid rows, or valid tokens for
'token-mean').
Every loss returns ``(loss, metrics)`` with scalar float32 metrics.

Defaults are what the paper states; where it is silent they follow FlowRL's veRL fork / veRL, and
the docstring says so. The options that exist to match a reference implementation name its file and
function. References read for this module: veRL ``verl/trainer/ppo/core_algos.py``
(``compute_grpo_outcome_advantage``, ``compute_policy_loss_vanilla``, ``compute_policy_loss_gspo``,
``agg_loss``, ``kl_penalty_forward``) and ``verl/trainer/config/actor/actor.yaml``; FlowRL
(github.com/Xuekai-Zhu/FlowRL, ``verl@FlowRL/verl/workers/actor/dp_actor.py``) and its recipe in
veRL (``recipe/flowrl/flowrl_actor.py``) and in the veRL fork (github.com/Xuekai-Zhu/verl_FlowRL).

Equation numbers are those of the compiled paper (``disa.tex``, numbered equations in order), with
the LaTeX labels: eq. (1) token ratio (``eq:bg:ratio``); eq. (2) clipped surrogate (``eq:bg:ppo``);
eq. (3) group z-score (``eq:bg:grpo-rhat``); eq. (4) the tilted target pi~ and Z(q)
(``eq:m:target``); eq. (5) the TB loss (``eq:bg:tb``); eq. (6) the FlowRL objective with rollout
weights (``eq:bg:flowrl``); eq. (10) the DISA objective (``eq:m:decrl``).
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from disa_jax.estimators.reward_transforms import transform_rewards
from disa_jax.scoring.logprobs import sequence_logprob

Array = jax.Array
Metrics = dict[str, Array]

OMEGA_MODES = ("one", "ratio", "clipped_ratio", "clamped_ratio")
IS_CORRECTIONS = ("none", "tis", "mis")  # behaviour -> pi_old correction (`behaviour_is_weights`)
AGG_KINDS = ("seq-mean-token-mean", "token-mean")
KL_KINDS = ("k1", "k3")


# ----------------------------------------------------------------------------------------------
# Masked reductions and shape helpers.
# ----------------------------------------------------------------------------------------------


def _f32(x: Any) -> Array:
  return jnp.asarray(x, jnp.float32)


def response_lengths(mask: Array) -> Array:
  """Number of response tokens per row: ``[B, T] -> [B]`` float32."""
  return _f32(mask).sum(-1)


def valid_rows(mask: Array) -> Array:
  """``[B]`` bool: rows with at least one response token."""
  return response_lengths(mask) > 0


def sequence_sum(x: Array, mask: Array) -> Array:
  """Masked sum over tokens: ``[B, T] -> [B]``."""
  return jnp.where(mask > 0, _f32(x), 0.0).sum(-1)


def sequence_mean(x: Array, mask: Array) -> Array:
  """Masked mean over tokens, 0 for empty rows: ``[B, T] -> [B]``."""
  return sequence_sum(x, mask) / jnp.maximum(response_lengths(mask), 1.0)


def masked_row_mean(x: Array, valid: Array) -> Array:
  """Mean of ``x [B]`` over rows where ``valid [B]``; 0 when none is valid."""
  v = _f32(valid)
  return (_f32(x) * v).sum() / jnp.maximum(v.sum(), 1.0)


def _masked_row_std(x: Array, valid: Array) -> Array:
  mean = masked_row_mean(x, valid)
  return jnp.sqrt(masked_row_mean((_f32(x) - mean)**2, valid))


def _masked_row_max(x: Array, valid: Array) -> Array:
  return jnp.where(valid, _f32(x), -jnp.inf).max(initial=-jnp.inf)


def _masked_row_min(x: Array, valid: Array) -> Array:
  return jnp.where(valid, _f32(x), jnp.inf).min(initial=jnp.inf)


def _masked_token_mean(x: Array, mask: Array) -> Array:
  m = _f32(mask > 0)
  return (jnp.where(mask > 0, _f32(x), 0.0)).sum() / jnp.maximum(m.sum(), 1.0)


def _check_agg(loss_agg: str) -> None:
  if loss_agg not in AGG_KINDS:
    raise ValueError(f"loss_agg must be one of {AGG_KINDS}, got {loss_agg!r}")


def aggregate(per_token: Array, mask: Array, loss_agg: str) -> Array:
  """Reduces a ``[B, T]`` per-token loss to a scalar.

  ``seq-mean-token-mean``: (1/B_valid) sum_i (1/T_i) sum_t l_it, the paper's eq. (2) (and TRL's
  ``loss_type='grpo'``). ``token-mean``: sum_it l_it / sum_i T_i over all valid tokens, veRL's
  ``agg_loss(loss_agg_mode='token-mean')`` (its default, ``actor.yaml`` ``loss_agg_mode``).

  Args:
    per_token: ``[B, T]`` per-token losses (values outside ``mask`` ignored).
    mask: ``[B, T]`` response mask.
    loss_agg: one of `AGG_KINDS`.

  Returns:
    Scalar float32 (0 when no token is valid).
  """
  _check_agg(loss_agg)
  if loss_agg == "token-mean":
    return _masked_token_mean(per_token, mask)
  return masked_row_mean(sequence_mean(per_token, mask), valid_rows(mask))


def loss_normalizer(loss_agg: str, mask: Array) -> Array:
  """The count a loss averages over, for exact micro-batch recombination.

  A loss L_k computed on micro-batch k of a mini-batch with ``loss_agg`` is a mean over n_k items;
  the mini-batch loss is sum_k n_k L_k / sum_k n_k, and likewise its gradient. The items are
  valid rows (sequences) for ``seq-mean-token-mean`` (GRPO's eq. 2; also what DISA, FlowRL and GSPO
  average over) and valid tokens for ``token-mean`` (GRPO with veRL's default).

  Args:
    loss_agg: one of `AGG_KINDS`.
    mask: ``[b, T]`` response mask of the micro-batch.

  Returns:
    Scalar float32 n_k: the number of rows with a response token, or of response tokens.
  """
  _check_agg(loss_agg)
  if loss_agg == "token-mean":
    return _f32(mask > 0).sum()
  return _f32(valid_rows(mask)).sum()


def expand_prompt_values(values: Array, batch_size: int, name: str = "log_z") -> Array:
  """Repeats per-prompt values ``[P]`` over the G = B // P responses of each prompt -> ``[B]``.

  Rows are prompt-major: row b belongs to prompt b // G.
  """
  values = _f32(values)
  if values.ndim != 1:
    raise ValueError(f"{name} must have shape [P], got shape {values.shape}")
  num_prompts = values.shape[0]
  if num_prompts == 0 or batch_size % num_prompts:
    raise ValueError(f"{name} has P={num_prompts} entries but the batch has B={batch_size} rows; "
                     "B must be a multiple of P (G = B // P responses per prompt)")
  return jnp.repeat(values, batch_size // num_prompts)  # [P] -> [P * G]


def _check_tokens(mask: Array, **arrays: Array) -> None:
  if mask.ndim != 2:
    raise ValueError(f"mask must have shape [B, T], got shape {mask.shape}")
  for name, a in arrays.items():
    if a is not None and a.shape != mask.shape:
      raise ValueError(f"{name} must have the mask's shape {mask.shape}, got shape {a.shape}")


def _check_rows(batch_size: int, **arrays: Array) -> None:
  for name, a in arrays.items():
    if a is not None and a.shape != (batch_size,):
      raise ValueError(f"{name} must have shape [B]=({batch_size},), got shape {a.shape}")


# ----------------------------------------------------------------------------------------------
# Advantages and rollout weights.
# ----------------------------------------------------------------------------------------------


def group_zscore_advantages(reward: Array,
                            mask: Array | None = None,
                            eps: float = 1e-6,
                            *,
                            ddof: int = 0) -> Array:
  """Group-normalised rewards r^_i = (r_i - mean_q) / (std_q + eps), eq. (3).

  Args:
    reward: ``[P, G]`` verifier rewards.
    mask: ``[P, G]`` bool valid samples, or None.
    eps: added to the std (a group with equal rewards gets 0 advantage); veRL uses 1e-6.
    ddof: 0 = population std as eq. (3) writes s_q (default); 1 = sample std as veRL's
      ``compute_grpo_outcome_advantage`` (``torch.std``), FlowRL and TRL compute it, with veRL's
      rule for a group of one valid sample (mean 0, std 1). See
      `disa_jax.estimators.reward_transforms`.

  Returns:
    ``[P, G]`` float32 advantages (0 where ``mask`` is False).
  """
  return transform_rewards(reward, mask, kind="group_zscore", eps=eps, ddof=ddof)


def rollout_weights(logp: Array,
                    old_logp: Array | None,
                    mask: Array,
                    *,
                    mode: str = "one",
                    max_weight: float = 10.0,
                    eps_low: float = 0.2,
                    eps_high: float = 0.28) -> tuple[Array, Array]:
  """Rollout weights omega_i of eqs. (6) and (10), per sequence and detached.

  Every mode but ``one`` starts from the trajectory ratio w_i = pi_theta(o_i|q) / pi_old(o_i|q) =
  exp(sum_t (logp - old_logp)) over the response tokens, under stop_gradient (all FlowRL versions
  detach it: ``torch.exp(log_w).detach()``):

  - ``one``: omega = 1, the on-policy value the paper states below eq. (6) (default).
  - ``ratio``: omega = w, unclipped. What FlowRL's released code computes
    (github.com/Xuekai-Zhu/FlowRL, ``verl@FlowRL/verl/workers/actor/dp_actor.py``,
    ``compute_flowrl_objective``: it also forms ``clamp(w, 1 - clip_ratio, 1 + clip_ratio)`` but
    multiplies the squared residual by the unclipped w), and the veRL fork's "vanilla" variant
    (``compute_flowrl_objective_vanilla``, ``FLOWRL_LOSS_VARIANT=vanilla``).
  - ``clipped_ratio``: omega = min(w, max_weight), max_weight 10: veRL's FlowRL recipe
    (``recipe/flowrl/flowrl_actor.py``, ``compute_flowrl``, ``torch.clamp(imp_w_raw, max=10)``) and
    the fork's ``recipe/flowrl/flowrl_objectives.py``.
  - ``clamped_ratio``: omega = clip(w, 1 - eps_low, 1 + eps_high), [0.8, 1.28] by default: the
    fork's "flowrl_clip" variant (``compute_flowrl_clip``, ``torch.clamp(imp_w_raw, 1 - 0.2,
    1 + 0.28)``); the first veRL recipe (``compute_flowrl_objective``) clamps to the actor's
    ``clip_ratio_low/high`` (0.2 / 0.28 in its run script) but also drops tokens with a CISPO mask,
    which is not reproduced here.

  For numerical safety the log ratio is capped at 80 before exp (float32 overflows near 88).

  Args:
    logp, old_logp: ``[B, T]`` token log-probs (old_logp may be None for ``one``).
    mask: ``[B, T]`` response mask.
    mode: one of `OMEGA_MODES`.
    max_weight: the upper clip for ``clipped_ratio`` (> 0).
    eps_low, eps_high: the clamp [1 - eps_low, 1 + eps_high] for ``clamped_ratio``.

  Returns:
    (omega ``[B]``, raw ratio w ``[B]``) both float32 and without gradient; the raw ratio is 1 for
    ``one``.
  """
  if mode not in OMEGA_MODES:
    raise ValueError(f"omega mode must be one of {OMEGA_MODES}, got {mode!r}")
  if mode == "one":
    ones = jnp.ones(mask.shape[:1], jnp.float32)
    return ones, ones
  if old_logp is None:
    raise ValueError(f"omega mode {mode!r} needs old_logp, got None")
  if mode == "clipped_ratio" and not max_weight > 0:
    raise ValueError(f"omega max_weight must be > 0, got {max_weight!r}")
  if mode == "clamped_ratio" and not (0 <= eps_low < 1 and eps_high >= 0):
    raise ValueError(f"omega clamp needs 0 <= eps_low < 1 and eps_high >= 0, got "
                     f"eps_low={eps_low!r}, eps_high={eps_high!r}")
  log_ratio = sequence_sum(jax.lax.stop_gradient(_f32(logp)) - _f32(old_logp), mask)  # [B]
  raw = jnp.exp(jnp.minimum(log_ratio, 80.0))
  if mode == "ratio":
    return raw, raw
  if mode == "clipped_ratio":
    return jnp.minimum(raw, max_weight), raw
  return jnp.clip(raw, 1.0 - eps_low, 1.0 + eps_high), raw


# ----------------------------------------------------------------------------------------------
# Trajectory balance: DISA (eq. 10) and FlowRL (eq. 6).
# ----------------------------------------------------------------------------------------------


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


def vargrad_loss(batch_log_z_rows: Array, logp: Array, ref_logp: Array, reward: Array,
                 mask: Array, **kwargs) -> tuple[Array, Metrics]:
  """VarGrad: the TB loss of eq. (5) with the batch estimate of `batch_log_z` as log Z.

  ``batch_log_z_rows`` is ``[B]`` (one value per row: the leave-one-out estimate differs within a
  group) and passes through stop_gradient. Keyword arguments are those of `tb_loss` (scale, omega
  weights, sample weights).
  """
  return tb_loss(jax.lax.stop_gradient(_f32(batch_log_z_rows)), logp, ref_logp, reward, mask,
                 **kwargs)


# ----------------------------------------------------------------------------------------------
# Reward maximisation: GRPO (eqs. 1-3) and GSPO.
# ----------------------------------------------------------------------------------------------


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
