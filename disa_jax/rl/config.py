"""Typed, validated configuration of a Stage 3 run (DISA, FlowRL, GRPO, GSPO).

The `configs/stage3_*.py` files build an `ml_collections.ConfigDict` with the same nested layout;
`TrainConfig.from_dict` converts it once, refusing unknown fields, and every dataclass validates its
values in ``__post_init__`` with an error that names the field and the value.
"""
from __future__ import annotations

import dataclasses
import typing
from typing import Any, Mapping

from disa_jax.estimators.reward_transforms import RewardTransform

METHODS = ("disa", "flowrl", "grpo", "gspo")
DTYPES = ("float32", "bfloat16")
OLD_LOGP_SOURCES = ("recompute", "engine")
ENGINES = ("jax", "vllm")


def _fail(cls: str, field: str, value: Any, need: str) -> None:
  raise ValueError(f"{cls}.{field} {need}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class ModelCfg:
  """Policy / reference model.

  Attributes:
    policy_path: local HF directory of the initial policy (pi_ref's weights; Alg. 1 line 9).
    reference_path: local HF directory of pi_ref ('' = same as policy_path).
    dtype: computation dtype.
    param_dtype: parameter storage dtype of the trained policy.
    remat: recompute decoder layers in the backward pass.
    scan_unroll: unroll of the scan over decoder layers (1 = a rolled loop, compile time flat in
      depth; num_layers = fully unrolled, faster backward on small models, longer compiles).
  """
  policy_path: str = ""
  reference_path: str = ""
  dtype: str = "bfloat16"
  param_dtype: str = "float32"
  remat: bool = True
  scan_unroll: int = 1

  def __post_init__(self):
    if self.scan_unroll < 1:
      _fail("model", "scan_unroll", self.scan_unroll, "must be >= 1")
    for f in ("dtype", "param_dtype"):
      if getattr(self, f) not in DTYPES:
        _fail("model", f, getattr(self, f), f"must be one of {DTYPES}")


@dataclasses.dataclass(frozen=True)
class LossCfg:
  """The objective (see `disa_jax.rl.losses`).

  Attributes:
    method: 'disa' | 'flowrl' | 'grpo' | 'gspo'.
    beta: inverse temperature of the TB residual (DISA / FlowRL).
    length_normalize: 1/|o| on the residual's log-prob terms (label scale 'mean') or trajectory
      sums ('sum'); DISA refuses an anchor fitted on the other scale.
    reward_transform: r -> r~ ('raw' | 'affine' | 'group_zscore'), as in Stage 1.
    omega_mode: 'one' | 'clipped_ratio' rollout weights (DISA / FlowRL).
    omega_max: the clip of the trajectory ratio.
    eps_low, eps_high: clip range of GRPO (token ratio) / GSPO (sequence ratio).
    dual_clip: GRPO dual-clip constant c > 1, or 0 for off.
    kl_coef: GRPO KL penalty coefficient to pi_ref (0 = off).
    kl_kind: 'k1' | 'k3'.
    logz_head_layers: FlowRL head depth (Linear layers).
    logz_head_lr: FlowRL head learning rate.
    logz_head_init: initial output bias of the FlowRL head (its initial log Z).
  """
  method: str = "disa"
  beta: float = 15.0
  length_normalize: bool = True
  reward_transform: RewardTransform = RewardTransform("group_zscore")
  omega_mode: str = "clipped_ratio"
  omega_max: float = 10.0
  eps_low: float = 0.2
  eps_high: float = 0.28
  dual_clip: float = 0.0
  kl_coef: float = 0.0
  kl_kind: str = "k3"
  logz_head_layers: int = 3
  logz_head_lr: float = 1e-6
  logz_head_init: float = 0.0

  def __post_init__(self):
    if self.method not in METHODS:
      _fail("loss", "method", self.method, f"must be one of {METHODS}")
    if not self.beta > 0:
      _fail("loss", "beta", self.beta, "must be > 0")
    if self.omega_mode not in ("one", "clipped_ratio"):
      _fail("loss", "omega_mode", self.omega_mode, "must be 'one' or 'clipped_ratio'")
    if not self.omega_max > 0:
      _fail("loss", "omega_max", self.omega_max, "must be > 0")
    if not 0 <= self.eps_low < 1:
      _fail("loss", "eps_low", self.eps_low, "must be in [0, 1)")
    if not self.eps_high >= 0:
      _fail("loss", "eps_high", self.eps_high, "must be >= 0")
    if self.dual_clip != 0 and not self.dual_clip > 1:
      _fail("loss", "dual_clip", self.dual_clip, "must be 0 (off) or > 1")
    if self.kl_coef < 0:
      _fail("loss", "kl_coef", self.kl_coef, "must be >= 0")
    if self.kl_kind not in ("k1", "k3"):
      _fail("loss", "kl_kind", self.kl_kind, "must be 'k1' or 'k3'")
    if self.logz_head_layers < 1:
      _fail("loss", "logz_head_layers", self.logz_head_layers, "must be >= 1")
    if not self.logz_head_lr > 0:
      _fail("loss", "logz_head_lr", self.logz_head_lr, "must be > 0")

  @property
  def label_scale(self) -> str:
    return "mean" if self.length_normalize else "sum"


@dataclasses.dataclass(frozen=True)
class OptimCfg:
  """AdamW with global-norm clipping.

  Attributes:
    lr: learning rate (paper: 1e-6).
    weight_decay: decoupled weight decay.
    b1, b2, eps: Adam moments.
    grad_clip: global-norm clip (<= 0 disables).
    warmup_steps: linear warm-up of the learning rate over optimizer updates.
  """
  lr: float = 1e-6
  weight_decay: float = 0.01
  b1: float = 0.9
  b2: float = 0.999
  eps: float = 1e-8
  grad_clip: float = 1.0
  warmup_steps: int = 0

  def __post_init__(self):
    if not self.lr > 0:
      _fail("optim", "lr", self.lr, "must be > 0")
    if self.weight_decay < 0:
      _fail("optim", "weight_decay", self.weight_decay, "must be >= 0")
    if not (0 <= self.b1 < 1 and 0 <= self.b2 < 1):
      _fail("optim", "b1/b2", (self.b1, self.b2), "must be in [0, 1)")
    if self.warmup_steps < 0:
      _fail("optim", "warmup_steps", self.warmup_steps, "must be >= 0")


@dataclasses.dataclass(frozen=True)
class RolloutCfg:
  """Training rollouts.

  Attributes:
    prompts_per_batch: prompts per RL step (paper: 128).
    group_size: G responses per prompt (paper: 8).
    max_prompt_len, max_response_len: token limits (paper: 2048, 16384).
    temperature, top_p, top_k: training sampling parameters.
    engine: 'jax' | 'vllm'.
    separate_process: run the engine in its own process.
    old_logp_source: 'recompute' (policy before the update scores the rollouts once) or 'engine'
      (the raw log-probs the engine recorded while sampling).
    num_minibatches: optimizer updates per rollout batch.
    micro_batch_size: sequences per forward/backward (gradient accumulation within a mini-batch).
  """
  prompts_per_batch: int = 128
  group_size: int = 8
  max_prompt_len: int = 2048
  max_response_len: int = 16384
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0
  engine: str = "jax"
  separate_process: bool = True
  old_logp_source: str = "recompute"
  num_minibatches: int = 4
  micro_batch_size: int = 8

  def __post_init__(self):
    for f in ("prompts_per_batch", "group_size", "max_prompt_len", "max_response_len",
              "num_minibatches", "micro_batch_size"):
      if getattr(self, f) < 1:
        _fail("rollout", f, getattr(self, f), "must be >= 1")
    if not self.temperature > 0:
      _fail("rollout", "temperature", self.temperature, "must be > 0")
    if not 0 < self.top_p <= 1:
      _fail("rollout", "top_p", self.top_p, "must be in (0, 1]")
    if self.engine not in ENGINES:
      _fail("rollout", "engine", self.engine, f"must be one of {ENGINES}")
    if self.old_logp_source not in OLD_LOGP_SOURCES:
      _fail("rollout", "old_logp_source", self.old_logp_source,
            f"must be one of {OLD_LOGP_SOURCES}")
    batch = self.prompts_per_batch * self.group_size
    if batch % self.num_minibatches:
      _fail("rollout", "num_minibatches", self.num_minibatches,
            f"must divide prompts_per_batch * group_size = {batch}")
    if (batch // self.num_minibatches) % self.micro_batch_size:
      _fail("rollout", "micro_batch_size", self.micro_batch_size,
            f"must divide the mini-batch size {batch // self.num_minibatches}")


@dataclasses.dataclass(frozen=True)
class DataCfg:
  """Prompts, rewards and the DISA anchor.

  Attributes:
    train_path: training prompts (veRL parquet / jsonl).
    reward: reward function name in `disa_jax.rewards` ('math' | 'code' | registered).
    anchor_path: directory of the frozen Stage 2 anchor (DISA only).
    shuffle: shuffle prompts each epoch (seeded).
  """
  train_path: str = ""
  reward: str = "math"
  anchor_path: str = ""
  shuffle: bool = True


REPLAY_SCHEDULES = ("constant", "linear_decay")


@dataclasses.dataclass(frozen=True)
class ReplayCfg:
  """Stage 1 replay in Stage 3 (DISA / FlowRL only; see `disa_jax.rl.replay`).

  Of the G samples of a prompt, round(fraction(step) * G) are Stage 1 proposal samples of that
  prompt (drawn without replacement, seeded by the step) and the rest are sampled on-policy, so the
  batch size and compute per step do not change. Replayed rows enter the TB residual like on-policy
  rows (Prop. 3(i): with a fixed log Z the minimiser is the tilted target for any full-support
  behaviour distribution); GRPO / GSPO refuse them (their ratios assume on-policy rollouts).

  Attributes:
    path: Stage 1 dataset (jsonl / parquet directory written by Stage 1); '' = replay off.
    fraction: share of each prompt's group replaced by Stage 1 samples, in [0, 1).
    schedule: 'constant' | 'linear_decay' (fraction -> 0 linearly over `decay_steps`).
    decay_steps: length of the linear decay (steps; 'linear_decay' only).
    max_ref_logp_drift: the median |stored log pi_ref - recomputed| (nats, trajectory sums) over the
      replayed rows of the first replay step must stay below this; a larger drift means the Stage 1
      file was scored with another reference model or prompt rendering.
  """
  path: str = ""
  fraction: float = 0.0
  schedule: str = "constant"
  decay_steps: int = 0
  max_ref_logp_drift: float = 0.05

  def __post_init__(self):
    if not 0.0 <= self.fraction < 1.0:
      _fail("replay", "fraction", self.fraction, "must be in [0, 1)")
    if self.schedule not in REPLAY_SCHEDULES:
      _fail("replay", "schedule", self.schedule, f"must be one of {REPLAY_SCHEDULES}")
    if self.schedule == "linear_decay" and self.decay_steps < 1:
      _fail("replay", "decay_steps", self.decay_steps, "must be >= 1 for schedule='linear_decay'")
    if self.fraction > 0 and not self.path:
      _fail("replay", "path", self.path, f"is required when replay.fraction={self.fraction} > 0")
    if not self.max_ref_logp_drift > 0:
      _fail("replay", "max_ref_logp_drift", self.max_ref_logp_drift, "must be > 0")

  @property
  def enabled(self) -> bool:
    return self.fraction > 0

  def fraction_at(self, step: int) -> float:
    """The replay fraction of RL step ``step`` (0-based)."""
    if self.schedule == "linear_decay":
      return self.fraction * max(0.0, 1.0 - step / self.decay_steps)
    return self.fraction


@dataclasses.dataclass(frozen=True)
class EvalCfg:
  """Periodic evaluation (paper: temperature 0.6, top-p 0.95, Mean@8 / pass@k).

  Attributes:
    every: evaluate every this many RL steps (0 = never).
    paths: benchmark prompt files.
    n: samples per prompt.
    temperature, top_p: sampling.
    max_tokens: response limit (paper: 32768).
  """
  every: int = 0
  paths: tuple[str, ...] = ()
  n: int = 8
  temperature: float = 0.6
  top_p: float = 0.95
  max_tokens: int = 32768

  def __post_init__(self):
    if self.every < 0:
      _fail("eval", "every", self.every, "must be >= 0")
    if self.n < 1:
      _fail("eval", "n", self.n, "must be >= 1")
    if not 0 < self.top_p <= 1:
      _fail("eval", "top_p", self.top_p, "must be in (0, 1]")


@dataclasses.dataclass(frozen=True)
class MeshCfg:
  """Device mesh sizes (-1 = all remaining devices)."""
  data: int = 1
  fsdp: int = -1
  tensor: int = 1


@dataclasses.dataclass(frozen=True)
class CheckpointCfg:
  """Checkpointing: every `every` steps, keep the last `keep`, async writes."""
  every: int = 50
  keep: int = 3
  async_save: bool = True

  def __post_init__(self):
    if self.every < 1:
      _fail("checkpoint", "every", self.every, "must be >= 1")
    if self.keep < 1:
      _fail("checkpoint", "keep", self.keep, "must be >= 1")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """A whole Stage 3 run.

  Attributes:
    seed: the run's PRNG seed.
    total_steps: RL steps (rollout batches).
    log_every: write metrics every this many steps.
    tensorboard: also write TensorBoard event files.
    progress_bar: show a tqdm bar with ETA.
  """
  model: ModelCfg = ModelCfg()
  loss: LossCfg = LossCfg()
  optim: OptimCfg = OptimCfg()
  rollout: RolloutCfg = RolloutCfg()
  data: DataCfg = DataCfg()
  replay: ReplayCfg = ReplayCfg()
  eval: EvalCfg = EvalCfg()
  mesh: MeshCfg = MeshCfg()
  checkpoint: CheckpointCfg = CheckpointCfg()
  seed: int = 0
  total_steps: int = 1000
  log_every: int = 1
  tensorboard: bool = True
  progress_bar: bool = True

  def __post_init__(self):
    if self.total_steps < 1:
      _fail("config", "total_steps", self.total_steps, "must be >= 1")
    if self.log_every < 1:
      _fail("config", "log_every", self.log_every, "must be >= 1")
    if self.loss.method == "disa" and not self.data.anchor_path:
      _fail("data", "anchor_path", self.data.anchor_path, "is required for method='disa'")
    if self.replay.enabled and self.loss.method not in ("disa", "flowrl"):
      _fail("replay", "fraction", self.replay.fraction,
            f"must be 0 for loss.method={self.loss.method!r} (off-policy Stage 1 samples would "
            "enter its ratio terms uncorrected; replay is for 'disa' and 'flowrl')")
    if self.replay.enabled and round(self.replay.fraction * self.rollout.group_size) < 1:
      _fail("replay", "fraction", self.replay.fraction,
            f"replays no sample of a group of rollout.group_size={self.rollout.group_size}")
    if self.replay.enabled and round(self.replay.fraction * self.rollout.group_size) >= (
        self.rollout.group_size):
      _fail("replay", "fraction", self.replay.fraction,
            f"leaves no on-policy sample in a group of {self.rollout.group_size}")

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> "TrainConfig":
    """Builds from a (nested) mapping such as ``ConfigDict.to_dict()``; unknown keys are errors."""
    return _build(cls, d, "config")

  def to_dict(self) -> dict[str, Any]:
    out = dataclasses.asdict(self)
    out["loss"]["reward_transform"] = self.loss.reward_transform.to_dict()
    return out


def _build(cls, d: Mapping[str, Any], where: str):
  if not isinstance(d, Mapping):
    raise ValueError(f"{where} must be a mapping, got {d!r}")
  hints = typing.get_type_hints(cls)
  fields = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(d) - fields)
  if unknown:
    raise ValueError(f"{where}: unknown field(s) {unknown}; known: {sorted(fields)}")
  kwargs = {}
  for name, value in d.items():
    tp = hints[name]
    if dataclasses.is_dataclass(tp) and tp is not RewardTransform:
      kwargs[name] = _build(tp, value, f"{where}.{name}")
    elif tp is RewardTransform:
      kwargs[name] = value if isinstance(value, RewardTransform) else RewardTransform.from_dict(
          dict(value))
    elif typing.get_origin(tp) is tuple:
      kwargs[name] = tuple(value)
    else:
      kwargs[name] = _coerce(tp, value, f"{where}.{name}")
  return cls(**kwargs)


def _coerce(tp, value, where):
  if tp is bool:
    if not isinstance(value, bool):
      raise ValueError(f"{where} must be a bool, got {value!r}")
    return value
  if tp is int:
    if isinstance(value, bool) or not isinstance(value, int):
      raise ValueError(f"{where} must be an int, got {value!r}")
    return value
  if tp is float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
      raise ValueError(f"{where} must be a number, got {value!r}")
    return float(value)
  if tp is str:
    if not isinstance(value, str):
      raise ValueError(f"{where} must be a string, got {value!r}")
    return value
  return value
