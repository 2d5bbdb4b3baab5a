"""Reward-maximising objectives (`disa_jax.rl.objectives`): GRPO and GSPO."""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import numpy as np

from disa_jax.rl import losses
from disa_jax.rl.objectives.base import Array, Objective, register


@dataclasses.dataclass(frozen=True, kw_only=True)
class PolicyGradient(Objective):
  """Clipped policy-gradient objectives on group z-score advantages (eq. 3).

  Attributes:
    eps_low, eps_high: the clip range [1 - eps_low, 1 + eps_high] of the ratio.
    ddof: the group std of the advantages: 0 (population, the paper's eq. 3) or 1 (the sample
      std of veRL's `compute_grpo_outcome_advantage`, FlowRL and TRL).
    is_correction: the behaviour -> pi_old correction of rollouts the engine sampled with other
      weights or numerics (`disa_jax.rl.losses.behaviour_is_weights`): 'none', 'tis' (truncated
      importance sampling, min(rho, is_cap)) or 'mis' (masked: rho if rho <= is_cap, else 0);
      GRPO weighs tokens, GSPO sequences (geometric mean).
    is_cap: C of 'tis' / 'mis' (veRL's rollout correction threshold: 2).
  """
  eps_low: float = 0.2
  eps_high: float = 0.2
  ddof: int = 0
  is_correction: str = "none"
  is_cap: float = 2.0
  is_level: ClassVar[str] = "token"

  maximises_reward: ClassVar[bool] = True

  def __post_init__(self):
    if not 0 <= self.eps_low < 1:
      raise ValueError(f"eps_low must be in [0, 1), got {self.eps_low!r}")
    if not self.eps_high >= 0:
      raise ValueError(f"eps_high must be >= 0, got {self.eps_high!r}")
    if self.ddof not in (0, 1):
      raise ValueError(f"ddof must be 0 or 1, got {self.ddof!r}")
    if self.is_correction not in losses.IS_CORRECTIONS:
      raise ValueError(f"is_correction must be one of {losses.IS_CORRECTIONS}, got "
                       f"{self.is_correction!r}")
    if not self.is_cap > 0:
      raise ValueError(f"is_cap must be > 0, got {self.is_cap!r}")

  @property
  def needs_old_logp(self) -> bool:
    return True

  @property
  def needs_behaviour_logp(self) -> bool:
    return self.is_correction != "none"

  @property
  def group_relative(self) -> str:
    return "its advantages are z-scores within each prompt's group (eq. 3)"

  def is_weights(self, batch: Any) -> tuple[Array | None, dict[str, Array]]:
    """The micro-batch's behaviour -> pi_old weights (None without a correction) and metrics."""
    if not self.needs_behaviour_logp:
      return None, {}
    if batch.behaviour_logp is None:
      raise ValueError(f"is_correction={self.is_correction!r} needs the engine's log-probs "
                       "(batch.behaviour_logp), got None")
    return losses.behaviour_is_weights(batch.old_logp, batch.behaviour_logp, batch.response_mask,
                                       batch.on_policy, mode=self.is_correction, cap=self.is_cap,
                                       level=self.is_level)

  def row_signal(self, reward: np.ndarray) -> np.ndarray:
    return np.asarray(losses.group_zscore_advantages(reward, ddof=self.ddof), np.float32)


@register
@dataclasses.dataclass(frozen=True, kw_only=True)
class Grpo(PolicyGradient):
  """GRPO, eqs. (1)-(3): the token-level clipped surrogate with group advantages.

  Attributes (beyond `PolicyGradient`; paper eq. 2: eps 0.2 / 0.2, no dual clip):
    dual_clip: c > 1 bounds the loss of negative-advantage tokens at -c A (veRL's dual clip,
      always on there with c = 3); 0 = off.
    kl_coef: coefficient of the per-token KL penalty to pi_ref (0 = off; the paper states none).
    kl_kind: 'k1' | 'k3' KL estimator.
    kl_clamp: the k3 estimate is clamped to [-kl_clamp, kl_clamp] (veRL's low_var_kl: 10); 0 = off.
    loss_agg: 'seq-mean-token-mean' (eq. 2, TRL's 'grpo') | 'token-mean' (veRL's default).
    kl_cov_ratio: KL-Cov's share of a micro-batch's valid tokens (the highest covariance between
      log-prob and advantage) that get the penalty kl_cov_coef |log pi - log pi_old| (Cui et al.
      2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning Language Models";
      `disa_jax.rl.losses.kl_cov_penalty`); 0 = off.
    kl_cov_coef: KL-Cov's coefficient (the paper: 1).

  The remedies for GRPO's entropy collapse that its users run are options here: clip-higher
  (``eps_high`` = 0.28 with ``eps_low`` = 0.2; DAPO, Yu et al. 2025, "DAPO: An Open-Source LLM
  Reinforcement Learning System at Scale") and KL-Cov (above).
  """
  name: ClassVar[str] = "grpo"
  dual_clip: float = 0.0
  kl_coef: float = 0.0
  kl_kind: str = "k3"
  kl_clamp: float = 10.0
  loss_agg: str = "seq-mean-token-mean"
  kl_cov_ratio: float = 0.0
  kl_cov_coef: float = 1.0

  def __post_init__(self):
    super().__post_init__()
    if self.dual_clip != 0 and not self.dual_clip > 1:
      raise ValueError(f"dual_clip must be 0 (off) or > 1, got {self.dual_clip!r}")
    if self.kl_coef < 0:
      raise ValueError(f"kl_coef must be >= 0, got {self.kl_coef!r}")
    if self.kl_kind not in losses.KL_KINDS:
      raise ValueError(f"kl_kind must be one of {losses.KL_KINDS}, got {self.kl_kind!r}")
    if self.kl_clamp < 0:
      raise ValueError(f"kl_clamp must be >= 0 (0 = off), got {self.kl_clamp!r}")
    if self.loss_agg not in losses.AGG_KINDS:
      raise ValueError(f"loss_agg must be one of {losses.AGG_KINDS}, got {self.loss_agg!r}")
    if not 0.0 <= self.kl_cov_ratio < 1.0:
      raise ValueError(f"kl_cov_ratio must be in [0, 1) (0 = off), got {self.kl_cov_ratio!r}")
    if not self.kl_cov_coef >= 0:
      raise ValueError(f"kl_cov_coef must be >= 0, got {self.kl_cov_coef!r}")

  @property
  def needs_reference(self) -> bool:
    return self.kl_coef > 0

  def loss(self, logp, batch, state_out=None):
    weights, is_metrics = self.is_weights(batch)
    loss, metrics = losses.grpo_loss(
        logp, batch.old_logp, batch.signal, batch.response_mask, eps_low=self.eps_low,
        eps_high=self.eps_high, dual_clip=self.dual_clip or None,
        ref_logp=batch.ref_logp if self.needs_reference else None, kl_coef=self.kl_coef,
        kl_kind=self.kl_kind, kl_clamp=self.kl_clamp or None, loss_agg=self.loss_agg,
        kl_cov_ratio=self.kl_cov_ratio, kl_cov_coef=self.kl_cov_coef, is_weights=weights)
    return loss, {**metrics, **is_metrics}

  def normalizer(self, batch: Any) -> Array:
    """Valid rows for 'seq-mean-token-mean', valid tokens for 'token-mean' (exact recombination)."""
    return losses.loss_normalizer(self.loss_agg, batch.response_mask)


@register
@dataclasses.dataclass(frozen=True, kw_only=True)
class Gspo(PolicyGradient):
  """GSPO: the sequence-level clipped surrogate with the geometric-mean ratio.

  Its clip range is that of the GSPO paper: (3e-4, 4e-4) on the length-normalised sequence ratio.
  """
  name: ClassVar[str] = "gspo"
  is_level: ClassVar[str] = "sequence"
  eps_low: float = 3e-4
  eps_high: float = 4e-4

  def loss(self, logp, batch, state_out=None):
    weights, is_metrics = self.is_weights(batch)
    loss, metrics = losses.gspo_loss(logp, batch.old_logp, batch.signal, batch.response_mask,
                                     eps_low=self.eps_low, eps_high=self.eps_high,
                                     is_weights=weights)
    return loss, {**metrics, **is_metrics}
