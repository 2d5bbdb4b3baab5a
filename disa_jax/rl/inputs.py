"""What a Stage 3 run is built on besides its config, in four groups (`build.build_trainer`).

- `StepModels`: the trained policy and the frozen pi_ref, the mesh they are placed on, and the
  padding granularity of unpacked rows;
- `RolloutTask`: the training and validation prompts, how responses are decoded and graded, the
  tokenizer's stop and pad ids, and the Stage 1 replay pool;
- `EngineLink`: this host's rollout engine and how the policy's weights are pushed to it;
- `AnchorInput`: the frozen anchor (objectives whose `Needs` has ``anchor``) and the identity it
  must have been fitted under.

Each part of a step takes the run's `TrainConfig` and the groups it reads, never the loose values.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

import jax

from disa_jax import config as config_lib
from disa_jax import models
from disa_jax.rewards.graded import RewardFn
from disa_jax.rl.prompts import PromptItem
from disa_jax.rl.replay import ReplayPool
from disa_jax.rollout import flat_weights
from disa_jax.rollout.types import Engine


@dataclasses.dataclass(frozen=True)
class StepModels:
  """The models of a run.

  Attributes:
    policy: the trained `Transformer` (initialised from pi_ref's weights; updated in place).
    reference: the frozen pi_ref `Transformer` (None if the objective needs neither it nor an
      anchor).
    mesh: the training mesh (None: `build_trainer` uses all devices on the fsdp axis).
    pad_to: without packing (``rollout.packing=False``), rows are padded to a multiple of this.
  """
  policy: models.Transformer
  reference: models.Transformer | None = None
  mesh: jax.sharding.Mesh | None = None
  pad_to: int = 64


@dataclasses.dataclass(frozen=True)
class RolloutTask:
  """The prompts of a run and how its responses are read and graded.

  Attributes:
    prompts: training prompts.
    reward_fn: the run's `RewardFn` (`disa_jax.rewards.get_reward_fn`).
    decode: response token ids -> text (special tokens skipped), for the reward function.
    stop_token_ids: tokens that end a response (EOS).
    pad_id: padding token id.
    validation_prompts: prompts for periodic validation (``validation`` section).
    replay_pool: Stage 1 samples for the ``replay`` section (None without replay).
  """
  prompts: Sequence[PromptItem]
  reward_fn: RewardFn
  decode: Callable[[Sequence[int]], str]
  stop_token_ids: tuple[int, ...]
  pad_id: int
  validation_prompts: Sequence[PromptItem] = ()
  replay_pool: ReplayPool | None = None


@dataclasses.dataclass(frozen=True)
class EngineLink:
  """This host's rollout engine and the weight push into it.

  Attributes:
    engine: the engine; it must start with the policy's weights. In a multi-process run each host
      leader passes its host's engine and the other processes None.
    push_dtype: dtype of the weights pushed (None: the parameters' own).
    push_bucket_bytes: bucket size of the flat push (`flat_weights.FlatLayout`; 0 = one bucket).
  """
  engine: Engine | None
  push_dtype: Any = None
  push_bucket_bytes: int = flat_weights.DEFAULT_BUCKET_BYTES

  def __post_init__(self):
    config_lib.check_count(self.push_bucket_bytes, "EngineLink push_bucket_bytes",
                           "0 = one bucket")


@dataclasses.dataclass(frozen=True)
class AnchorInput:
  """The frozen anchor of the run, unchecked (`build.validate_anchor` checks it once).

  Attributes:
    anchor: the `disa_jax.anchor.Anchor` (or table anchor); None for objectives without one.
    identity: ``reference=`` / ``rendering=`` the anchor must have been fitted under.
    source: where the anchor came from (e.g. ``data.anchor_path='...'``), prefixed to a mismatch.
  """
  anchor: Any = None
  identity: Mapping[str, str] | None = None
  source: str = ""
