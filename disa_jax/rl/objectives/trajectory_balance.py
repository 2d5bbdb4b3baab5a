"""Trajectory-balance objectives (`disa_jax.rl.objectives`): DISA with its frozen anchor (and its
batch-centred control), FlowRL with its co-trained log Z head, VarGrad with the batch estimate."""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax.numpy as jnp
import numpy as np
from flax import nnx

from disa_jax.estimators.dataset import LABEL_SCALES
from disa_jax.estimators.reward_transforms import RewardTransform
from disa_jax.rl import losses
from disa_jax.rl.logz_head import POOLINGS, LogZHead, packed_mean_embedding
from disa_jax.rl.objectives.base import HEAD_OPTIMIZERS, Objective, ObjectiveState, register


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrajectoryBalance(Objective):
  """The squared TB residual of eqs. (6) / (10) over rollout weights omega.

  Attributes:
    beta: inverse temperature of the tilted target (paper: 15).
    scale: 'sum' (the paper's trajectory residual, eqs. 5-10; Props. 1-3 are stated for it) or
      'mean' (1/|o| on the log-prob terms, FlowRL's implementation). Stage 1 labels and the DISA
      anchor must use the same scale.
    reward_transform: r -> r~ of the residual (group z-score: the plug-in of FlowRL's code; the
      paper's statements are for a fixed affine transform).
    omega: rollout weights w = pi_theta(o) / pi_old(o), detached, per sequence
      (`disa_jax.rl.losses.rollout_weights`): 'one' (on-policy, the paper's omega = 1), 'ratio'
      (w; FlowRL HEAD), 'clipped_ratio' (min(w, omega_max); veRL's flowrl recipe) or
      'clamped_ratio' (clip(w, 1 - omega_eps_low, 1 + omega_eps_high); the fork's flowrl_clip).
    omega_max: the clip of 'clipped_ratio' (FlowRL: 10).
    omega_eps_low, omega_eps_high: the clamp of 'clamped_ratio' (the fork: 0.2, 0.28).
  """
  beta: float = 15.0
  scale: str = "sum"
  reward_transform: RewardTransform = RewardTransform(kind="group_zscore")
  behaviour_as_old_logp: ClassVar[bool] = True
  omega: str = "one"
  omega_max: float = 10.0
  omega_eps_low: float = 0.2
  omega_eps_high: float = 0.28

  allows_replay: ClassVar[bool] = True
  matches_target: ClassVar[bool] = True

  def __post_init__(self):
    if not self.beta > 0:
      raise ValueError(f"beta must be > 0, got {self.beta!r}")
    if self.scale not in LABEL_SCALES:
      raise ValueError(f"scale must be one of {LABEL_SCALES}, got {self.scale!r}")
    if self.omega not in losses.OMEGA_MODES:
      raise ValueError(f"omega must be one of {losses.OMEGA_MODES}, got {self.omega!r}")
    if not self.omega_max > 0:
      raise ValueError(f"omega_max must be > 0, got {self.omega_max!r}")

  @property
  def needs_reference(self) -> bool:
    return True

  @property
  def needs_old_logp(self) -> bool:
    return self.omega != "one"

  @property
  def group_relative(self) -> str:
    if self.reward_transform.kind == "group_zscore":
      return "its reward_transform z-scores the rewards within each prompt's group"
    return ""

  def row_signal(self, reward: np.ndarray) -> np.ndarray:
    return np.asarray(self.reward_transform.apply(reward), np.float32)

  def _tb_kwargs(self, batch: Any) -> dict[str, Any]:
    return dict(beta=self.beta, length_normalize=self.scale == "mean", old_logp=batch.old_logp,
                omega_mode=self.omega, omega_max=self.omega_max,
                omega_eps_low=self.omega_eps_low, omega_eps_high=self.omega_eps_high)


@register
@dataclasses.dataclass(frozen=True, kw_only=True)
class Disa(TrajectoryBalance):
  """DISA, eq. (10): the TB residual with the frozen Stage 2 anchor g_psi*(q) as log Z.

  The batch carries the anchor's value for each row's prompt (``batch.log_z``); it passes through
  stop_gradient, so no gradient reaches psi. The anchor must have been fitted on labels with this
  objective's beta, reward transform and scale (`check_anchor`).
  """
  name: ClassVar[str] = "disa"
  needs_anchor: ClassVar[bool] = True

  def loss(self, logp, batch, state_out=None):
    return losses.disa_loss(batch.log_z, logp, batch.ref_logp, batch.signal,
                            batch.response_mask, **self._tb_kwargs(batch))

  def check_anchor(self, anchor: Any, *, embedding_dim: int | None, **identity: str) -> None:
    """Refuses an anchor whose labels used another beta, reward transform, scale or width, or
    (``identity``: ``reference=``, ``rendering=``) another reference model or prompt rendering."""
    anchor.check_compatible(beta=self.beta, reward_transform=self.reward_transform,
                            label_scale=self.scale, embedding_dim=embedding_dim, **identity)


def _response_mask(rollout: Any) -> np.ndarray:
  """``[B, W]`` 1 on each row's response tokens (a `RolloutBatch`'s padded layout)."""
  lengths = np.asarray([len(r) for r in rollout.response_ids])
  return (np.arange(rollout.response_width)[None, :] < lengths[:, None]).astype(np.float32)


def _check_scored(batch: Any, fields: tuple[str, ...], who: str) -> None:
  for field in fields:
    if getattr(batch, field) is None:
      raise ValueError(f"{who} needs batch.{field}, got None")


@register
@dataclasses.dataclass(frozen=True, kw_only=True)
class DisaCentred(Disa):
  """DISA's frozen log Z with the batch's mean residual removed (issue 63's control).

  The residual of eq. (10) at log Z_c(q) = log Z(q) - sg[mean over the batch of R_j at pi_old]
  (`disa_jax.rl.losses.batch_centred_log_z`): the frozen log Z (the fitted anchor, or the exact
  value with ``anchor='exact'``) plus a constant baseline, so that the gradient differs from DISA's
  only by that constant times E[grad log pi]. On-policy at the sum scale every TB cell has the same
  expected gradient (Prop. 3(ii)); what a frozen log Z changes is the baseline, and this cell
  removes its common part while keeping its differences across prompts (VarGrad removes each
  prompt's own mean). The baseline is taken on the host at the rollout policy, as VarGrad's.
  """
  name: ClassVar[str] = "disa_centred"
  needs_batch_log_z: ClassVar[bool] = True
  behaviour_as_old_logp: ClassVar[bool] = False

  @property
  def needs_old_logp(self) -> bool:
    return True

  def batch_log_z(self, batch: Any) -> np.ndarray:
    """``[B]`` float32 centred log Z of each row, from the anchor's ``batch.log_z`` at pi_old."""
    _check_scored(batch, ("log_z", "old_logp", "ref_logp", "signal"), "DisaCentred.batch_log_z")
    return np.asarray(losses.batch_centred_log_z(
        np.asarray(batch.log_z, np.float32), batch.old_logp, batch.ref_logp,
        np.asarray(batch.signal, np.float32).reshape(-1), _response_mask(batch.rollout),
        beta=self.beta, length_normalize=self.scale == "mean"), np.float32)


@register
@dataclasses.dataclass(frozen=True, kw_only=True)
class FlowRL(TrajectoryBalance):
  """FlowRL, eq. (6): the TB residual with a co-trained log Z_phi head on the policy's prompt states.

  FlowRL's head (`proj_z`) sits on the policy's prompt states; the paper does not describe it, so the
  defaults follow FlowRL's code: 3 layers, dropout 0.1 after each LayerNorm, torch's initialisation,
  pooling over the prompt positions but the last.

  Attributes (beyond `TrajectoryBalance`):
    head_layers: Linear layers of the head (FlowRL: 3).
    head_lr: the head's learning rate with ``head_optimizer='separate'``.
    head_init: added to the head's initial output bias (its initial log Z offset).
    head_dropout: dropout after each LayerNorm during training (FlowRL: 0.1).
    head_pooling: 'exclude_last_prompt_token' (FlowRL) | 'all_prompt_tokens'
      (`disa_jax.rl.logz_head.POOLINGS`).
    head_optimizer: 'separate' (its own AdamW at ``head_lr`` with its own gradient clip) or
      'joint' (FlowRL's code: the head is part of the actor, so one global-norm clip over policy +
      head gradients and the policy's AdamW settings, learning rate included).
  """
  name: ClassVar[str] = "flowrl"
  has_state: ClassVar[bool] = True
  head_layers: int = 3
  head_lr: float = 1e-6
  head_init: float = 0.0
  head_dropout: float = 0.1
  head_pooling: str = "exclude_last_prompt_token"
  head_optimizer: str = "separate"

  def __post_init__(self):
    super().__post_init__()
    if self.head_layers < 1:
      raise ValueError(f"head_layers must be >= 1, got {self.head_layers!r}")
    if not self.head_lr > 0:
      raise ValueError(f"head_lr must be > 0, got {self.head_lr!r}")
    if not 0.0 <= self.head_dropout < 1.0:
      raise ValueError(f"head_dropout must be in [0, 1), got {self.head_dropout!r}")
    if self.head_pooling not in POOLINGS:
      raise ValueError(f"head_pooling must be one of {POOLINGS}, got {self.head_pooling!r}")
    if self.head_optimizer not in HEAD_OPTIMIZERS:
      raise ValueError(f"head_optimizer must be one of {HEAD_OPTIMIZERS}, got "
                       f"{self.head_optimizer!r}")

  def init_state(self, hidden_size, seed, make_optimizer, policy_lr):
    """The log Z head (`disa_jax.rl.logz_head.LogZHead`) and its optimizer: its own AdamW at
    ``head_lr`` ('separate') or the policy's learning rate under one joint clip ('joint')."""
    joint = self.head_optimizer == "joint"
    head = LogZHead(hidden_size, self.head_layers, rngs=nnx.Rngs(seed("logz_head")),
                    init_bias=self.head_init, dropout_rate=self.head_dropout)
    optimizer = make_optimizer(policy_lr if joint else self.head_lr, clip=not joint)
    return ObjectiveState(head, optimizer, clip_with_policy=joint, key_seed=seed("head_dropout"),
                          name="head")

  def state_forward(self, module, hidden, batch, key):
    """The head on the masked mean of the prompt's hidden states (``head_pooling``); with shared
    prompts each slot reads its unit's prompt (`TrainBatch.prompt_slot`); dropout with ``key``."""
    emb = packed_mean_embedding(hidden, batch.rows.prompt_mask, batch.rows.token_slot,
                                batch.num_slots, pooling=self.head_pooling)  # [S, D]
    if batch.prompt_slot is not None:
      emb = jnp.take(emb, batch.prompt_slot, axis=0)  # [S, D]
    return module(emb, dropout_key=key if self.head_dropout > 0 else None)  # [S]

  def loss(self, logp, batch, state_out=None):
    if state_out is None:
      raise ValueError("FlowRL.loss needs the head's log Z values, got None")
    return losses.flowrl_loss(state_out, logp, batch.ref_logp, batch.signal,
                              batch.response_mask, **self._tb_kwargs(batch))


@register
@dataclasses.dataclass(frozen=True, kw_only=True)
class VarGrad(TrajectoryBalance):
  """Trajectory balance with the batch estimate of log Z: the log-variance ("VarGrad") loss.

  Per prompt q with a group of rows i (on-policy and, with replay, replayed), and
  t_i = beta r~_i - log pi_old(o_i|q) + log pi_ref(o_i|q) (trajectory sums for scale 'sum', times
  1/|o_i| for 'mean'):

      log Z^(q) = sg[ mean_{j in group(q)} t_j ]   (leave-one-out: the mean over j != i)
      L(theta) = (1/B) sum_i omega_i (log Z^(q) + log pi_theta(o_i|q) - log pi_ref(o_i|q) - beta r~_i)^2

  eq. (5) with log Z^ in place of log Z; `disa_jax.rl.losses.batch_log_z` has the derivation.
  Sources: Richter et al. 2020, "VarGrad: a low-variance gradient estimator for variational
  inference" (the log-variance loss), and Bartoldson et al. 2025, "Trajectory balance with
  asynchrony" (TBA: the same batch log Z for trajectory balance on LLMs). It needs no Stage 1,
  Stage 2 or log Z head; any per-prompt offset of log Z cancels exactly within a group.

  The estimate is taken on the host at the rollout policy pi_old (`batch_log_z`, after
  `row_signal`): with one optimizer update per rollout batch pi_old = pi_theta there, and this is
  exactly the VarGrad loss; with ``rollout.num_minibatches`` > 1 the later updates keep the
  rollout-time estimate (it is not recomputed per mini-batch, whose rows split the groups).

  Attributes (beyond `TrajectoryBalance`):
    leave_one_out: row i's estimate is the mean over the other rows of its group (an estimate
      independent of o_i; needs G >= 2).
  """
  name: ClassVar[str] = "vargrad"
  needs_batch_log_z: ClassVar[bool] = True
  # log Z^ is taken at the current policy (its batch mean of beta r~ - log pi + log pi_ref), so
  # pi_old is recomputed, never the stale behaviour's log-probs.
  behaviour_as_old_logp: ClassVar[bool] = False
  leave_one_out: bool = False

  @property
  def needs_old_logp(self) -> bool:
    return True

  @property
  def group_relative(self) -> str:
    return "its log Z is the mean of each prompt's group (its residuals sum to 0 within a group)"

  def batch_log_z(self, batch: Any) -> np.ndarray:
    """``[B]`` float32 log Z^ of each row (`disa_jax.rl.losses.batch_log_z` at pi_old).

    Args:
      batch: a `disa_jax.rl.batch.ScoredBatch` (``old_logp``, ``ref_logp``, ``signal``; its
        rollout's group size and responses).
    """
    _check_scored(batch, ("old_logp", "ref_logp", "signal"), "VarGrad.batch_log_z")
    rollout = batch.rollout
    if self.leave_one_out and rollout.group_size < 2:
      raise ValueError(f"leave_one_out needs group_size >= 2, got {rollout.group_size}")
    mask = _response_mask(rollout)
    return np.asarray(losses.batch_log_z(
        batch.old_logp, batch.ref_logp, np.asarray(batch.signal, np.float32).reshape(-1), mask,
        group_size=rollout.group_size, beta=self.beta, length_normalize=self.scale == "mean",
        leave_one_out=self.leave_one_out), np.float32)

  def loss(self, logp, batch, state_out=None):
    return losses.vargrad_loss(batch.log_z, logp, batch.ref_logp, batch.signal,
                               batch.response_mask, **self._tb_kwargs(batch))
