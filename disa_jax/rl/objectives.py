"""Stage 3 objectives as objects: one small frozen class per method, asked and never compared by name.

Each objective carries its own hyperparameters (with the paper's defaults) and declares what a
Stage 3 step must provide for it:

| objective | loss | needs_reference | needs_anchor | has_state | allows_replay |
|---|---|---|---|---|---|
| `Disa` | eq. (10): TB residual with the frozen anchor g_psi(q) | yes | yes | no | yes |
| `FlowRL` | eq. (6): TB residual with a co-trained log Z head | yes | no | yes | yes |
| `VarGrad` | eq. (5) with the stop-gradient batch mean of each group as log Z (log-variance loss) | yes | no | no | yes |
| `Grpo` | eqs. (1)-(3): token-clipped surrogate, group z-score advantages | if kl_coef > 0 | no | no | no |
| `Gspo` | sequence-clipped surrogate with the geometric-mean ratio | no | no | no | no |
| `ReplaySft` | NLL of the replayed reward-1 rows (the replay fix's control) | no | no | no | required |

The trainer asks the objective: which passes to run (`needs_reference`, `needs_old_logp`), what
per-row signal the update reads (`row_signal`: the transformed reward r~ for TB objectives, the
group advantage for policy-gradient ones), the loss of a micro-batch (`loss`), and the weight of a
micro-batch when gradients are recombined (`normalizer`). Replay is refused for objectives whose
ratio terms assume on-policy rollouts.

An objective may own trainable state (``has_state``: FlowRL's log Z head): `init_state` builds
its parameters (an `nnx.Module`) and their optimizer (`ObjectiveState`), `state_forward` maps them
and the policy's forward to the extra input of `loss` (``state_out``). The update carries that state as an
opaque slot beside the policy's (`disa_jax.rl.train_step.TrainState` ``obj_params`` /
``obj_opt_state``) and never looks inside it.

Adding an objective is one class here: subclass `Objective` (or `TrajectoryBalance`), declare its
needs, implement `row_signal` and `loss` (and, with state, `init_state` and `state_forward`), and
decorate it with `@register`. Configs select it with ``objective.name`` and set its fields by name
(`Objective.from_config`); see `docs/objectives.md`.
"""
from __future__ import annotations

import abc
import dataclasses
from typing import Any, Callable, ClassVar, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from disa_jax.config import from_mapping
from disa_jax.estimators.dataset import LABEL_SCALES
from disa_jax.estimators.reward_transforms import RewardTransform
from disa_jax.rl import losses
from disa_jax.rl.logz_head import POOLINGS, LogZHead, packed_mean_embedding

HEAD_OPTIMIZERS = ("separate", "joint")

Array = jax.Array
REGISTRY: dict[str, type["Objective"]] = {}


def register(cls: type["Objective"]) -> type["Objective"]:
  """Class decorator: makes ``cls`` selectable by its ``name`` in configs."""
  if cls.has_state and (cls.init_state is Objective.init_state
                        or not callable(getattr(cls, "state_forward", None))):
    raise TypeError(f"objective {cls.name!r} declares has_state: it must define init_state and "
                    "state_forward (see Objective)")
  if cls.name in REGISTRY:
    raise ValueError(f"objective {cls.name!r} is already registered ({REGISTRY[cls.name]})")
  REGISTRY[cls.name] = cls
  return cls


def names() -> tuple[str, ...]:
  return tuple(sorted(REGISTRY))


@dataclasses.dataclass(frozen=True)
class ObjectiveState:
  """An objective's trainable state, as `Objective.init_state` builds it.

  Attributes:
    module: the parameters (its `nnx.Param` variables are trained beside the policy's, never synced
      to the rollout engine nor exported).
    optimizer: their optax transformation.
    clip_with_policy: one global-norm clip over the policy's and these gradients together, at the
      policy's ``optim.grad_clip``, before both optimizers (which then must not clip themselves).
    key_seed: seeds the key the update gives the objective's ``state_forward`` (folded with the
      update count and the micro-batch index, so a resumed run draws the same keys).
    name: the checkpoint's keys of this state, ``<name>_params`` and ``<name>_opt_state``.
  """
  module: nnx.Module
  optimizer: optax.GradientTransformation
  clip_with_policy: bool = False
  key_seed: int = 0
  name: str = "objective"


@dataclasses.dataclass(frozen=True)
class Objective(abc.ABC):
  """Base class of the Stage 3 objectives (see the module docstring).

  An objective with ``has_state`` defines `init_state` and ``state_forward(module, hidden, batch,
  key) -> state_out`` (`register` refuses one without them): ``module`` is its
  `ObjectiveState.module` with the current parameters, ``hidden`` the policy's ``[R, L, D]`` final
  hidden states of the packed rows, ``batch`` the micro-batch (`disa_jax.rl.batch.TrainBatch`),
  ``key`` a PRNG key different for every micro-batch and update (`ObjectiveState.key_seed`); its
  result is what `loss` receives as ``state_out`` (FlowRL: ``[S]`` log Z per slot).
  """

  name: ClassVar[str] = ""
  needs_anchor: ClassVar[bool] = False
  # The objective owns trainable parameters (`init_state`, `state_forward`; FlowRL's log Z head).
  has_state: ClassVar[bool] = False
  # The batch carries a log Z estimated from the step's own samples (`VarGrad.batch_log_z`, set
  # by `disa_jax.rl.objective_step.ObjectiveStep` after the scorer and `row_signal`); such an
  # objective reads ``batch.old_logp``.
  needs_batch_log_z: ClassVar[bool] = False
  allows_replay: ClassVar[bool] = False
  # Whether the loss's minimiser is the reward-tilted target pi~ (distribution matching) rather
  # than a reward maximiser (what reports compare against).
  matches_target: ClassVar[bool] = False
  # Whether the loss maximises the expected reward (the reports' contrasts for the target matchers).
  maximises_reward: ClassVar[bool] = False
  # How the objective treats a behaviour policy mu != pi_old (stale rollouts,
  # ``rollout.max_staleness`` > 0): True reads the engine's log-probs of mu as ``old_logp`` (TB:
  # omega weighs each row by pi_theta / mu, and TB's fixed point holds under any full-support mu,
  # Prop. 3(i)); False recomputes pi_old, the policy before the step's updates, and corrects
  # mu -> pi_old itself where it declares so (`PolicyGradient.is_correction`).
  behaviour_as_old_logp: ClassVar[bool] = False

  @property
  def needs_reference(self) -> bool:
    """The loss reads ``batch.ref_logp`` (log pi_ref of the sampled tokens)."""
    return False

  @property
  def needs_old_logp(self) -> bool:
    """The loss reads ``batch.old_logp`` (log pi_old, the rollout policy)."""
    return False

  @property
  def needs_behaviour_logp(self) -> bool:
    """The loss reads ``batch.behaviour_logp`` (the engine's log-probs of the sampled tokens)."""
    return False

  @property
  def group_relative(self) -> str:
    """Why a row's signal is relative to the other rows of its prompt's group ('' when it is not).

    Such an objective needs groups of at least 2 rows (`disa_jax.rl.config.TrainConfig` refuses
    fewer): a group of one has nothing to be relative to, so every row's signal is 0 (a z-score
    or a batch mean of one value).
    """
    return ""

  @abc.abstractmethod
  def row_signal(self, reward: np.ndarray) -> np.ndarray:
    """The per-row scalar the loss reads, from raw rewards ``[P, G]`` -> ``[P, G]`` float32."""

  def batch_signal(self, reward: np.ndarray, is_replay: np.ndarray) -> np.ndarray:
    """The per-row signal of a rollout batch, ``[P, G]`` -> ``[P, G]`` float32, from its raw rewards
    and its replay flags (``is_replay``: the row is a replayed Stage 1 sample). `row_signal` unless
    the objective treats replayed rows apart."""
    del is_replay  # on-policy and replayed rows alike
    return self.row_signal(reward)

  def init_state(self, hidden_size: int, seed: Callable[[str], int],
                 make_optimizer: Callable[..., optax.GradientTransformation],
                 policy_lr: float) -> ObjectiveState | None:
    """The objective's trainable state (None: it has none; objectives with ``has_state`` build one).

    Args:
      hidden_size: the policy's hidden width D (what `state_forward` receives).
      seed: ``name -> int``, a seed derived from the run's seed and ``name``.
      make_optimizer: ``(lr, clip=True) -> optax transformation`` with the run's ``optim`` settings
        (``clip=False``: without its own gradient clip, for ``clip_with_policy``).
      policy_lr: the policy's learning rate.
    """
    del hidden_size, seed, make_optimizer, policy_lr
    return None

  @abc.abstractmethod
  def loss(self, logp: Array, batch: Any, state_out: Array | None = None
           ) -> tuple[Array, dict[str, Array]]:
    """The loss of one micro-batch and its metrics (see `disa_jax.rl.losses`).

    Args:
      logp: ``[b, T]`` token log-probs of the current policy.
      batch: the micro-batch (`disa_jax.rl.batch.TrainBatch`, ``[b, T]`` / ``[b]`` fields).
      state_out: `state_forward`'s output (objectives with ``has_state``; FlowRL: ``[b]`` log Z).

    Returns:
      (scalar loss averaged so that `normalizer` recombines micro-batches exactly, metrics).
    """

  def normalizer(self, batch: Any) -> Array:
    """A micro-batch's weight when its gradient is recombined: its number of valid rows.

    Every loss here is a mean over valid rows, so weighting micro-batch gradients by this count
    gives the gradient of the whole mini-batch's loss.
    """
    return losses.valid_rows(batch.response_mask).sum().astype(np.float32)

  def check_replay(self, fraction: float) -> None:
    if fraction > 0 and not self.allows_replay:
      raise ValueError(f"replay.fraction={fraction} is not allowed for objective {self.name!r}: "
                       "its ratio terms assume on-policy rollouts (replay is for objectives with "
                       "allows_replay: " + ", ".join(n for n, c in sorted(REGISTRY.items())
                                                     if c.allows_replay) + ")")

  def to_config(self) -> dict[str, Any]:
    out = {"name": self.name}
    for f in dataclasses.fields(self):
      v = getattr(self, f.name)
      out[f.name] = v.to_dict() if isinstance(v, RewardTransform) else v
    return out

  @classmethod
  def from_config(cls, value: Any, where: str = "objective") -> "Objective":
    """Builds the objective named by ``value['name']`` with the other entries as its fields."""
    value = value.to_dict() if hasattr(value, "to_dict") else value
    if isinstance(value, Objective):
      return value
    if not isinstance(value, Mapping) or "name" not in value:
      raise ValueError(f"{where} must be a mapping with a 'name' in {names()}, got {value!r}")
    name = value["name"]
    if name not in REGISTRY:
      raise ValueError(f"{where}.name must be one of {names()}, got {name!r}")
    obj = from_mapping(REGISTRY[name], {k: v for k, v in value.items() if k != "name"}, where)
    if cls is not Objective and not isinstance(obj, cls):
      raise ValueError(f"{where}.name={name!r} is not a {cls.__name__}")
    return obj


def default_config(name: str) -> dict[str, Any]:
  """Every field of objective ``name`` with its default (a config file's starting point)."""
  if name not in REGISTRY:
    raise ValueError(f"objective name must be one of {names()}, got {name!r}")
  return REGISTRY[name]().to_config()


# ----------------------------------------------------------------------------------------------
# Trajectory balance: DISA and FlowRL.
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
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
  reward_transform: RewardTransform = RewardTransform("group_zscore")
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
@dataclasses.dataclass(frozen=True)
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


@register
@dataclasses.dataclass(frozen=True)
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
@dataclasses.dataclass(frozen=True)
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
      batch: a `disa_jax.rl.batch.SignalBatch` (``old_logp``, ``ref_logp``, ``signal``).
    """
    for field in ("old_logp", "ref_logp", "signal"):
      if getattr(batch, field) is None:
        raise ValueError(f"VarGrad.batch_log_z needs batch.{field}, got None")
    if self.leave_one_out and batch.group_size < 2:
      raise ValueError(f"leave_one_out needs group_size >= 2, got {batch.group_size}")
    lengths = np.asarray([len(r) for r in batch.response_ids])
    mask = (np.arange(batch.response_width)[None, :] < lengths[:, None]).astype(np.float32)
    return np.asarray(losses.batch_log_z(
        batch.old_logp, batch.ref_logp, np.asarray(batch.signal, np.float32).reshape(-1), mask,
        group_size=batch.group_size, beta=self.beta, length_normalize=self.scale == "mean",
        leave_one_out=self.leave_one_out), np.float32)

  def loss(self, logp, batch, state_out=None):
    return losses.vargrad_loss(batch.log_z, logp, batch.ref_logp, batch.signal,
                               batch.response_mask, **self._tb_kwargs(batch))


# ----------------------------------------------------------------------------------------------
# Reward maximisation: GRPO and GSPO.
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
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
@dataclasses.dataclass(frozen=True)
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
@dataclasses.dataclass(frozen=True)
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


# ----------------------------------------------------------------------------------------------
# Supervised learning on replayed samples: the control of the replay fix.
# ----------------------------------------------------------------------------------------------


@register
@dataclasses.dataclass(frozen=True)
class ReplaySft(Objective):
  """Supervised learning on the replayed Stage 1 samples: the negative log-likelihood of each
  replayed row that the verifier accepted, on-policy rows weighted 0 (`disa_jax.rl.losses.sft_loss`).

  With the replay of `disa_pos_replay` (reward-1, deduplicated, k rows per prompt and step) it
  trains on the same samples for the same steps as the fix, so the two differ only in the loss: TB
  against a frozen log Z versus maximum likelihood. It needs replay (``train.replay.fraction`` > 0).
  The loss is the mean over all valid rows (on-policy rows count 0), so a step's gradient is that of
  the replayed rows' mean NLL times their share of the rows, k / (G + k).
  """
  name: ClassVar[str] = "replay_sft"
  allows_replay: ClassVar[bool] = True

  def check_replay(self, fraction: float) -> None:
    if not fraction > 0:
      raise ValueError(f"objective {self.name!r} learns from replayed rows only: it needs "
                       f"replay.fraction > 0, got {fraction}")

  def row_signal(self, reward: np.ndarray) -> np.ndarray:
    """1 for the rows the verifier accepted (raw reward > 0.5), 0 otherwise."""
    return np.asarray(np.asarray(reward) > 0.5, np.float32)

  def batch_signal(self, reward: np.ndarray, is_replay: np.ndarray) -> np.ndarray:
    """`row_signal` on the replayed rows, 0 on the on-policy ones."""
    return self.row_signal(reward) * np.asarray(is_replay, np.float32)

  def loss(self, logp, batch, state_out=None):
    return losses.sft_loss(logp, batch.signal, batch.response_mask)
