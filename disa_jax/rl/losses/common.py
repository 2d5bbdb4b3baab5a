"""Shared pieces of the Stage 3 losses (`disa_jax.rl.losses`): masked reductions over response
tokens and rows, loss aggregation and its micro-batch normaliser, per-prompt values repeated over
their G rows, group z-score advantages (eq. 3) and FlowRL's rollout weights (eq. 6)."""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from disa_jax.estimators.reward_transforms import transform_rewards

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
