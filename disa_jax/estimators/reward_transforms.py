"""Reward transforms r -> r~ shared by Stage 1 labels and the Stage 3 residual.

The paper states its guarantees for a fixed prompt-conditional affine transform
r~(q, o) = a_q * r(q, o) + b_q with a_q > 0 (§2.1, below eq. 3), and uses the group z-score of
eq. (3) as its finite-sample plug-in, as FlowRL does. Three kinds are offered:

- ``raw``:          r~ = r
- ``affine``:       r~ = a * r + b, with fixed scalars a > 0, b
- ``group_zscore``: r~_i = (r_i - mean_q) / (std_q + eps), mean and std over the valid samples of one
                    prompt. ``ddof`` picks the std:

  - ``ddof=0`` (default): the population std s_q^2 = (1/G) sum_i (r_i - mean_q)^2 of the paper's
    eq. (3). A group with one valid sample, or whose rewards are all equal, has std 0 and maps to 0.
  - ``ddof=1``: the sample std (Bessel, 1/(G-1)), as veRL's ``compute_grpo_outcome_advantage``
    (``verl/trainer/ppo/core_algos.py``, ``torch.std``) computes the GRPO advantages that FlowRL's
    veRL fork feeds its TB loss as the reward, and as TRL's GRPOTrainer does (``nanstd``). With
    G = 8, every value is sqrt(7/8) ~ 0.935 times its ``ddof=0`` value. eps is added to the std in
    both references (veRL 1e-6, TRL 1e-4), so an all-equal group maps to 0. A group with one valid
    sample follows veRL: mean 0 and std 1, i.e. r~ = r / (1 + eps). (TRL never trains with G = 1, it
    requires ``num_generations >= 2``; at evaluation it sets the std to 0 there, giving 0.)

Stage 1 records the transform with its labels (``RewardTransform.to_dict``) and Stage 3 refuses an
anchor fitted under a different one (``RewardTransform.check_matches``).
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from disa_jax import codec

KINDS = ("raw", "affine", "group_zscore")
DDOFS = (0, 1)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RewardTransform:
  """A reward transform, recorded with the Stage 1 labels and the Stage 3 run.

  Attributes:
    kind: one of ``raw``, ``affine``, ``group_zscore``.
    scale: a in r~ = a r + b (``affine`` only; must be > 0).
    shift: b in r~ = a r + b (``affine`` only).
    eps: added to the group std (``group_zscore`` only; must be > 0).
    ddof: 0 (population std, the paper's eq. 3) or 1 (sample std, veRL / FlowRL / TRL);
      ``group_zscore`` only. Records written before this field existed load with 0.
  """

  kind: str = "raw"
  scale: float = 1.0
  shift: float = 0.0
  eps: float = 1e-6
  ddof: int = 0

  def __post_init__(self):
    if self.kind not in KINDS:
      raise ValueError(f"RewardTransform.kind must be one of {KINDS}, got {self.kind!r}")
    if not self.scale > 0:
      raise ValueError(f"RewardTransform.scale must be > 0 (a_q > 0 in the paper), got {self.scale!r}")
    if not self.eps > 0:
      raise ValueError(f"RewardTransform.eps must be > 0, got {self.eps!r}")
    if self.ddof not in DDOFS:
      raise ValueError(f"RewardTransform.ddof must be one of {DDOFS}, got {self.ddof!r}")

  def apply(self, reward: jnp.ndarray, mask: jnp.ndarray | None = None) -> jnp.ndarray:
    """Applies the transform; see `transform_rewards`."""
    return transform_rewards(reward, mask, kind=self.kind, scale=self.scale, shift=self.shift, eps=self.eps,
                             ddof=self.ddof)

  JSON_STRICT = True  # (`codec`: unknown keys are refused)

  def check_matches(self, other: "RewardTransform", what: str = "anchor") -> None:
    """Raises if ``other`` differs from this transform (e.g. the anchor's vs the run's)."""
    if self != other:
      raise ValueError(
          f"reward transform mismatch: this run uses {codec.encode(self)} but the {what} was built with "
          f"{codec.encode(other)}; refit the {what} or change reward_transform")


def transform_rewards(reward: jnp.ndarray,
                      mask: jnp.ndarray | None = None,
                      *,
                      kind: str = "raw",
                      scale: float = 1.0,
                      shift: float = 0.0,
                      eps: float = 1e-6,
                      ddof: int = 0) -> jnp.ndarray:
  """Transforms verifier rewards, per prompt group.

  Args:
    reward: ``[P, N]`` rewards of N samples for each of P prompts.
    mask: ``[P, N]`` bool, True where the sample is valid; None means all valid. Invalid entries
      are ignored by the group statistics and returned as 0.
    kind: ``raw`` | ``affine`` | ``group_zscore`` (see module docstring).
    scale, shift: the affine a and b.
    eps: added to the group std for ``group_zscore`` (r - mean) / (std + eps).
    ddof: ``group_zscore`` std: 0 = population (eq. 3), 1 = sample std with veRL's rule for a
      group of one valid sample (mean 0, std 1); see the module docstring.

  Returns:
    ``[P, N]`` float32 transformed rewards r~; 0 where ``mask`` is False.
  """
  r = jnp.asarray(reward, jnp.float32)
  m = jnp.ones(r.shape, bool) if mask is None else jnp.asarray(mask, bool)
  if kind == "raw":
    out = r
  elif kind == "affine":
    out = scale * r + shift
  elif kind == "group_zscore":
    if ddof not in DDOFS:
      raise ValueError(f"group_zscore ddof must be one of {DDOFS}, got {ddof!r}")
    n = m.sum(-1, keepdims=True)  # [P, 1] valid samples per group
    cnt = jnp.maximum(n, 1)
    mean = jnp.where(m, r, 0.0).sum(-1, keepdims=True) / cnt
    ss = jnp.where(m, (r - mean) ** 2, 0.0).sum(-1, keepdims=True)  # [P, 1]
    std = jnp.sqrt(ss / jnp.maximum(n - ddof, 1))
    if ddof == 1:  # veRL: a group of one sample gets mean 0 and std 1
      single = n == 1
      mean = jnp.where(single, 0.0, mean)
      std = jnp.where(single, 1.0, std)
    out = (r - mean) / (std + eps)
  else:
    raise ValueError(f"reward transform kind must be one of {KINDS}, got {kind!r}")
  return jnp.where(m, out, 0.0)
