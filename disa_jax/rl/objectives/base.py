"""The objective protocol (`Objective`, `ObjectiveState`), its registry (`register`, `names`,
`default_config`) and the policy's share of the objective interface (`disa_jax.rl.objectives`)."""
from __future__ import annotations

import abc
import dataclasses
from typing import Any, Callable, ClassVar, Mapping

import jax
import numpy as np
import optax
from flax import nnx

from disa_jax.config import to_dict
from disa_jax.rl import losses

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


OLD_LOGP_FROM = ("", "update", "behaviour", "recompute", "engine")


@dataclasses.dataclass(frozen=True)
class Needs:
  """What an objective reads from a step's batch under a run's rollout settings, resolved once
  (`Objective.needs`): the scorer's passes and the loss's inputs follow from it alone.

  Attributes:
    reference: ``ref_logp``, log pi_ref of every sampled token (the reference model scores them).
    anchor: ``log_z`` of each row's prompt from the frozen anchor (on pi_ref's prompt embeddings
      where the anchor regresses on them: pi_ref is loaded for it too).
    old_logp: where log pi_old comes from: '' (not read); 'update' (the update's own forward: one
      on-policy update per batch of recomputed pi_old that nothing reads on the host first);
      'behaviour' (stale rollouts of an objective with ``behaviour_as_old_logp``: the engine's
      log-probs of mu, replayed rows recomputed); 'recompute' (the policy scores the batch before
      the update); 'engine' (the engine's log-probs, all rows recomputed when any is replayed).
    batch_log_z: the batch's log Z is estimated from its own samples (VarGrad) after the signal.
    behaviour_logp: the loss reads the engine's log-probs of the sampled tokens itself (TIS).
  """
  reference: bool = False
  anchor: bool = False
  old_logp: str = ""
  batch_log_z: bool = False
  behaviour_logp: bool = False

  def __post_init__(self):
    if self.old_logp not in OLD_LOGP_FROM:
      raise ValueError(f"Needs.old_logp must be one of {OLD_LOGP_FROM}, got {self.old_logp!r}")

  @property
  def reference_model(self) -> bool:
    """pi_ref must be loaded (its log-probs, or the prompt embeddings an anchor is queried on)."""
    return self.reference or self.anchor

  @property
  def old_logp_on_host(self) -> bool:
    """The scorer computes ``old_logp`` before the update (every source but '' and 'update')."""
    return self.old_logp not in ("", "update")


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


@dataclasses.dataclass(frozen=True, kw_only=True)
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
  # by `disa_jax.rl.scorer.BatchScorer.score` after the signal); such an objective reads
  # ``batch.old_logp``.
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
  # A config's objective section is the registered objective its ``name`` entry picks, the other
  # entries its fields (`disa_jax.codec`'s tagged union; ``name`` written first).
  JSON_TAG: ClassVar[str] = "name"
  JSON_VARIANTS: ClassVar[Mapping[str, type]] = REGISTRY

  def needs(self, rollout: Any) -> Needs:
    """What this objective reads under the ``rollout`` section (`disa_jax.rl.config.
    RolloutConfig`: mini-batches per batch, ``old_logp_source``, ``max_staleness``), resolved from
    its declarations (``needs_reference``, ``needs_old_logp``, ``needs_anchor``,
    ``needs_batch_log_z``, ``needs_behaviour_logp``, ``behaviour_as_old_logp``)."""
    old = ""
    if self.needs_old_logp:
      stale_behaviour = bool(rollout.max_staleness) and self.behaviour_as_old_logp
      if (rollout.num_minibatches == 1 and rollout.old_logp_source == "recompute"
          and not self.needs_batch_log_z and not stale_behaviour):
        old = "update"
      else:
        old = "behaviour" if stale_behaviour else rollout.old_logp_source
    return Needs(reference=self.needs_reference, anchor=self.needs_anchor, old_logp=old,
                 batch_log_z=self.needs_batch_log_z, behaviour_logp=self.needs_behaviour_logp)

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

def default_config(name: str) -> dict[str, Any]:
  """Every field of objective ``name`` with its default (a config file's starting point)."""
  if name not in REGISTRY:
    raise ValueError(f"objective name must be one of {names()}, got {name!r}")
  return to_dict(REGISTRY[name]())
