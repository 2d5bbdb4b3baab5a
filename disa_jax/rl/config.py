"""What the Stage 3 `Trainer` reads: `TrainConfig` and its sections, typed and validated.

Paths, models, engines and meshes belong to the command (`disa_jax.workflows.stage3.Stage3Config`);
this config holds only what the training loop itself uses. Configs are built from ConfigDicts by
`disa_jax.config.from_mapping` (the ``train`` section of `configs/stage3_base.py`), and every
dataclass validates its values in ``__post_init__`` with an error naming the field and the value.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from disa_jax import codec
from disa_jax.data.packing import PackingLayout, micro_batch_layout, round_up
from disa_jax.rl.objectives import Disa, Needs, Objective

OLD_LOGP_SOURCES = ("recompute", "engine")
REPLAY_SCHEDULES = ("constant", "linear_decay")
REPLAY_MODES = ("replace", "add")


def _fail(section: str, field: str, value: Any, need: str) -> None:
  raise ValueError(f"{section}.{field} {need}, got {value!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimConfig:
  """AdamW with global-norm clipping.

  Attributes:
    lr: learning rate (paper: 1e-6).
    weight_decay: decoupled weight decay.
    b1, b2, eps: Adam moments.
    grad_clip: global-norm clip (<= 0 disables).
    warmup_steps: linear warm-up of the learning rate over optimizer updates.
    decay_frac: the last this share of the run's optimizer updates use lr * decay_factor (a final
      low-learning-rate phase: it removes the last wrong mass the constant lr leaves, issue 15's
      end state); 0 = a constant lr.
    decay_factor: the learning-rate factor of that phase.
  """
  lr: float = 1e-6
  weight_decay: float = 0.01
  b1: float = 0.9
  b2: float = 0.999
  eps: float = 1e-8
  grad_clip: float = 1.0
  warmup_steps: int = 0
  decay_frac: float = 0.0
  decay_factor: float = 0.1

  def __post_init__(self):
    if not self.lr > 0:
      _fail("optim", "lr", self.lr, "must be > 0")
    if self.weight_decay < 0:
      _fail("optim", "weight_decay", self.weight_decay, "must be >= 0")
    if not (0 <= self.b1 < 1 and 0 <= self.b2 < 1):
      _fail("optim", "b1/b2", (self.b1, self.b2), "must be in [0, 1)")
    if self.warmup_steps < 0:
      _fail("optim", "warmup_steps", self.warmup_steps, "must be >= 0")
    if not 0.0 <= self.decay_frac < 1.0:
      _fail("optim", "decay_frac", self.decay_frac, "must be in [0, 1)")
    if not 0.0 < self.decay_factor <= 1.0:
      _fail("optim", "decay_factor", self.decay_factor, "must be in (0, 1]")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutConfig:
  """Training rollouts and how the batch is split into updates.

  Attributes:
    prompts_per_batch: prompts per RL step (paper: 128).
    group_size: G responses per prompt (paper: 8); >= 2 for an objective whose signal is relative
      to its group (`Objective.group_relative`: GRPO, GSPO, VarGrad, a group z-scored reward).
    max_prompt_len, max_response_len: token limits (paper: 2048, 16384).
    temperature, top_p, top_k: training sampling parameters.
    old_logp_source: 'recompute' (the policy before the update scores the rollouts once) or
      'engine' (the raw log-probs the engine recorded while sampling).
    num_minibatches: optimizer updates per rollout batch (each on an equal share of the
      sequences).
    packing: pack several sequences into each row (`disa_jax.data.packing`): micro-batches are a
      token budget of ``micro_batch_rows`` x ``row_len`` tokens, one compiled shape. False: one
      sequence per row, every row padded to the rollout batch's longest sequence (kept for
      comparison; one compiled shape per length bucket).
    row_len: tokens per packed row; 0 = max_prompt_len + max_response_len (a row must hold the
      longest sequence).
    micro_batch_rows: rows per forward/backward (gradient accumulation within a mini-batch) and per
      scoring pass; on a mesh it is rounded up to a multiple of the data x fsdp batch shards
      (`layout`'s ``shards``; e.g. 8 rows on fsdp=6 -> 12), so any mesh works.
    seqs_per_row: most sequences in one packed row (sequence slots per micro-batch =
      micro_batch_rows x seqs_per_row).
    share_prompts: with packing, the update and its scoring passes (pi_ref, pi_old) put each
      prompt once in a row, followed by as many of its G responses as fit; each response attends
      to the prompt and to itself only (`disa_jax.data.packing`), so log-probs and gradients are
      those of separate sequences while the prompt is computed once per row instead of G times.
    max_staleness: k, rollout batches sampled ahead of the update (`disa_jax.rl.async_rollout`):
      the engine samples the batch of step t + k with the weights after step t while the trainer
      updates, so batch t comes from the policy k updates old (0 = the synchronous loop, each batch
      from the current weights). Objectives treat the older behaviour policy as they declare
      (`Objective.behaviour_as_old_logp`; GRPO / GSPO: ``is_correction``).
    mismatch_threshold: ``mismatch/frac_over`` counts response tokens whose trainer log-prob and
      engine (behaviour) log-prob differ by more than this many nats.
  """
  prompts_per_batch: int = 128
  group_size: int = 8
  max_prompt_len: int = 2048
  max_response_len: int = 16384
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0
  old_logp_source: str = "recompute"
  num_minibatches: int = 4
  packing: bool = True
  row_len: int = 0
  micro_batch_rows: int = 8
  seqs_per_row: int = 16
  share_prompts: bool = False
  max_staleness: int = 0
  mismatch_threshold: float = 0.1

  def __post_init__(self):
    for f in ("prompts_per_batch", "group_size", "max_prompt_len", "max_response_len",
              "num_minibatches", "micro_batch_rows", "seqs_per_row"):
      if getattr(self, f) < 1:
        _fail("rollout", f, getattr(self, f), "must be >= 1")
    if not self.temperature > 0:
      _fail("rollout", "temperature", self.temperature, "must be > 0")
    if not 0 < self.top_p <= 1:
      _fail("rollout", "top_p", self.top_p, "must be in (0, 1]")
    if self.top_k < 0:
      _fail("rollout", "top_k", self.top_k, "must be >= 0 (0 = off)")
    if self.old_logp_source not in OLD_LOGP_SOURCES:
      _fail("rollout", "old_logp_source", self.old_logp_source,
            f"must be one of {OLD_LOGP_SOURCES}")
    if not isinstance(self.max_staleness, int) or self.max_staleness < 0:
      _fail("rollout", "max_staleness", self.max_staleness, "must be an int >= 0 (0 = synchronous)")
    if self.max_staleness and self.old_logp_source == "engine":
      _fail("rollout", "old_logp_source", self.old_logp_source,
            f"must be 'recompute' with rollout.max_staleness={self.max_staleness}: the engine's "
            "log-probs are those of the stale behaviour policy, not of pi_old (the objectives read "
            "them as the behaviour's)")
    if not self.mismatch_threshold > 0:
      _fail("rollout", "mismatch_threshold", self.mismatch_threshold, "must be > 0")
    if self.share_prompts and not self.packing:
      _fail("rollout", "share_prompts", self.share_prompts,
            "needs rollout.packing=True (one sequence per row has no prompt to share)")
    longest = self.max_prompt_len + self.max_response_len
    if self.row_len < 0 or 0 < self.row_len < longest:
      _fail("rollout", "row_len", self.row_len,
            f"must be 0 or >= max_prompt_len + max_response_len = {longest} (a row holds the "
            "longest sequence)")

  def layout(self, lengths: Any, pad_to: int, shards: int = 1) -> PackingLayout:
    """The micro-batch layout of a rollout batch whose sequences have ``lengths`` tokens.

    Packing: fixed rows of ``row_len`` tokens (with ``share_prompts``, each prompt once per row).
    Without packing: one sequence per row, every row as long as the batch's longest sequence
    rounded up to ``pad_to``. ``shards``: the mesh's batch shards (`disa_jax.parallel.
    batch_shards`); rows per micro-batch are ``micro_batch_rows`` rounded up to a multiple of it.
    """
    if self.packing:
      row_len = self.packed_row_len
    else:
      row_len = round_up(max(lengths, default=1), pad_to)
    return micro_batch_layout(self.micro_batch_rows, packing=self.packing, row_len=row_len,
                              shards=shards, seqs_per_row=self.seqs_per_row,
                              share_prompts=self.share_prompts,
                              max_segment_len=self.max_segment_len)

  @property
  def packed_row_len(self) -> int:
    """Tokens per packed row: ``row_len``, or max_prompt_len + max_response_len when 0."""
    return self.row_len or self.max_prompt_len + self.max_response_len

  @property
  def max_segment_len(self) -> int:
    """The longest segment a packed row can hold (0 = the row: no bound below it): one sequence,
    max_prompt_len + max_response_len tokens (prompts are refused and responses cut at their
    limits), when that is shorter than ``row_len``; with ``share_prompts`` a unit (a prompt and
    several responses) may fill its row. The models' ``max_segment_len`` (the 'xla' attention's
    band) and `layout`'s (refused on the host while packing) are this one bound."""
    longest = self.max_prompt_len + self.max_response_len
    if not self.packing or self.share_prompts or longest >= (self.row_len or longest):
      return 0
    return longest


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReplayConfig:
  """Stage 1 replay in Stage 3 (objectives with ``allows_replay``; see `disa_jax.rl.replay`).

  k = round(fraction(step) * G) Stage 1 proposal samples of each prompt (drawn without replacement,
  seeded by the step) enter its group: with ``mode='replace'`` they take k of the G slots (the
  engine samples G - k; batch size and compute per step unchanged); with ``mode='add'`` they come on
  top of the G on-policy samples (groups of G + k rows), so the on-policy rows that remove the
  policy's own wrong answers are not starved. Replayed rows enter the TB residual like on-policy
  rows (Prop. 3(i): with a fixed log Z the minimiser is the tilted target for any full-support
  behaviour distribution). The Stage 1 file is the command's (``data.replay_path``).

  ``correct_only`` keeps the samples the verifier accepted (raw reward > 0.5): on-policy TB pushes a
  correct answer up at a rate proportional to its current probability (the rich get richer; see
  docs/real_checkpoints.md), and replayed correct answers push at the proposal's rate instead, which
  keeps the rare correct answers alive. With ``dedupe`` a response drawn several times in Stage 1
  counts once in the pool.

  Attributes:
    fraction: k / G, in [0, 1) for 'replace' (some on-policy samples must remain); (0, 1] for
      'add'.
    mode: 'replace' | 'add' (see above).
    correct_only: replay only the Stage 1 samples with raw reward > 0.5.
    dedupe: identical Stage 1 responses of a prompt count once.
    first_samples: keep only the first this many Stage 1 samples of each prompt (before the
      filters above; 0 = all): e.g. the N samples behind the Stage 2 labels (``stage2.samples``),
      which the paper keeps while it discards the rest of the pool.
    schedule: 'constant' | 'linear_decay' (fraction -> 0 linearly over `decay_steps`).
    decay_steps: length of the linear decay (steps; 'linear_decay' only).
    max_ref_logp_drift: the median |stored log pi_ref - recomputed| (nats, trajectory sums) over the
      replayed rows of the first replay step must stay below this; a larger drift means the Stage 1
      file was scored with another reference model or prompt rendering.
  """
  fraction: float = 0.0
  mode: str = "replace"
  correct_only: bool = False
  dedupe: bool = False
  first_samples: int = 0
  schedule: str = "constant"
  decay_steps: int = 0
  max_ref_logp_drift: float = 0.05

  def __post_init__(self):
    if self.mode not in REPLAY_MODES:
      _fail("replay", "mode", self.mode, f"must be one of {REPLAY_MODES}")
    top = 1.0 if self.mode == "add" else 1.0 - 1e-12
    if not 0.0 <= self.fraction <= top:
      _fail("replay", "fraction", self.fraction,
            "must be in [0, 1]" if self.mode == "add" else "must be in [0, 1)")
    if self.first_samples < 0:
      _fail("replay", "first_samples", self.first_samples, "must be >= 0 (0 = every sample)")
    if self.schedule not in REPLAY_SCHEDULES:
      _fail("replay", "schedule", self.schedule, f"must be one of {REPLAY_SCHEDULES}")
    if self.schedule == "linear_decay" and self.decay_steps < 1:
      _fail("replay", "decay_steps", self.decay_steps, "must be >= 1 for schedule='linear_decay'")
    if not self.max_ref_logp_drift > 0:
      _fail("replay", "max_ref_logp_drift", self.max_ref_logp_drift, "must be > 0")

  @property
  def enabled(self) -> bool:
    return self.fraction > 0

  def fraction_at(self, step: int) -> float:
    """The replay fraction of RL step ``step`` (0-based). With 'add', the rows it no longer
    replays (a decaying schedule) are sampled on-policy: a step always has G + k(0) rows."""
    if self.schedule == "linear_decay":
      return self.fraction * max(0.0, 1.0 - step / self.decay_steps)
    return self.fraction


@dataclasses.dataclass(frozen=True, kw_only=True)
class ValidationConfig:
  """Periodic validation during training (paper protocol: temperature 0.6, top-p 0.95).

  Attributes:
    every: validate every this many RL steps (0 = never); from step ``dense_from`` on where
      ``early_every`` is set.
    early_every: before RL step ``dense_from``, validate every this many steps instead (0 = at
      ``every`` throughout): a sparse start and a dense end, where the end-state rule reads the
      curves (`disa_jax.pipeline.job_config.TrackConfig.every_before_window`).
    dense_from: the first RL step of the ``every`` cadence (with ``early_every`` only).
    start_every, start_until: a third phase before both (issue 62: a dense start, then a sparse
      middle, then a dense end): every ``start_every`` steps up to step ``start_until``.
    at_start: also validate the initial policy, before step 1 (logged as step 0; with validation
      prompts it is a candidate of the checkpoint selection, saved as checkpoint 0).
    n: samples per prompt (Mean@n, pass@n). The checkpoint selection metric is Mean@n: the
      paper's Mean@8 for math, and for code the pass@1 estimate from n samples.
    temperature, top_p: sampling.
    max_tokens: response limit (paper: 32768).
  """
  every: int = 0
  at_start: bool = False
  n: int = 8
  temperature: float = 0.6
  top_p: float = 0.95
  max_tokens: int = 32768
  # added since: recorded only where set, so that runs written before them resume
  early_every: int = codec.field(default=0, omit=0)
  dense_from: int = codec.field(default=0, omit=0)
  start_every: int = codec.field(default=0, omit=0)
  start_until: int = codec.field(default=0, omit=0)

  def due(self, step: int) -> bool:
    """Whether RL step ``step`` (1-based: the steps done) is validated."""
    if self.start_every and step <= self.start_until:
      every = self.start_every
    elif self.early_every and step < self.dense_from:
      every = self.early_every
    else:
      every = self.every
    return bool(every) and step % every == 0

  def __post_init__(self):
    if self.every < 0:
      _fail("validation", "every", self.every, "must be >= 0")
    if self.early_every < 0 or self.dense_from < 0:
      _fail("validation", "early_every / dense_from", (self.early_every, self.dense_from),
            "must be >= 0")
    if self.early_every and not (self.every and self.dense_from):
      _fail("validation", "early_every", self.early_every,
            f"needs every > 0 and dense_from > 0 (the steps it covers), got every={self.every}, "
            f"dense_from={self.dense_from}")
    if self.start_every < 0 or self.start_until < 0 or (self.start_every and not (
        self.every and self.start_until)):
      _fail("validation", "start_every / start_until", (self.start_every, self.start_until),
            f"must be >= 0, with start_every > 0 needing every > 0 and start_until > 0, got "
            f"every={self.every}")
    if self.n < 1:
      _fail("validation", "n", self.n, "must be >= 1")
    if not 0 < self.top_p <= 1:
      _fail("validation", "top_p", self.top_p, "must be in (0, 1]")
    if self.max_tokens < 1:
      _fail("validation", "max_tokens", self.max_tokens, "must be >= 1")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
  """Checkpointing: every `every` steps (and at the end), keep the last `keep` plus the best by
  validation (saved when it is validated, `disa_jax.checkpoint.selection`), async writes."""
  every: int = 50
  keep: int = 3
  async_save: bool = True

  def __post_init__(self):
    if self.every < 1:
      _fail("checkpoint", "every", self.every, "must be >= 1")
    if self.keep < 1:
      _fail("checkpoint", "keep", self.keep, "must be >= 1")


WANDB_MODES = ("online", "offline")


@dataclasses.dataclass(frozen=True, kw_only=True)
class WandbConfig:
  """Weights & Biases as a metrics sink beside JSONL and TensorBoard (`disa_jax.rl.metrics`).

  Attributes:
    enabled: log every metrics row to wandb too (needs the optional ``wandb`` package).
    project: the wandb project.
    entity: the wandb team or user; '' = wandb's default entity of the logged-in user.
    name: the run's display name; '' = the run directory's base name.
    tags: the run's tags.
    mode: 'online' (stream to the server) | 'offline' (write under <workdir>/wandb for `wandb sync`).
  """
  enabled: bool = False
  project: str = "disa_jax"
  entity: str = ""
  name: str = ""
  tags: tuple[str, ...] = ()
  mode: str = "online"

  def __post_init__(self):
    if not self.project:
      _fail("wandb", "project", self.project, "must be a non-empty project name")
    if self.mode not in WANDB_MODES:
      _fail("wandb", "mode", self.mode, f"must be one of {WANDB_MODES}")
    for i, tag in enumerate(self.tags):
      if not isinstance(tag, str) or not tag:
        _fail("wandb", f"tags[{i}]", tag, "must be a non-empty string")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
  """Everything the Stage 3 `Trainer` reads.

  Attributes:
    objective: the objective and its hyperparameters (`disa_jax.rl.objectives`; a config section
      with ``name`` and the class's fields).
    optim, rollout, replay, validation, checkpoint: the sections above.
    seed: the run's PRNG seed (sampling, shuffling, replay draws, the log Z head).
    total_steps: RL steps (rollout batches). It sets the learning-rate schedule's decay phase
      (``optim.decay_frac``), so a Stage 3 run cannot be resumed with another value (its
      identity, `disa_jax.workflows.stage3`).
    shuffle: reshuffle the prompts every epoch (seeded).
    log_every: write metrics every this many steps.
    tensorboard: also write TensorBoard event files.
    wandb: also log to Weights & Biases (off by default).
    progress_bar: show a tqdm bar with ETA.
  """
  objective: Objective = Disa()
  optim: OptimConfig = OptimConfig()
  rollout: RolloutConfig = RolloutConfig()
  replay: ReplayConfig = ReplayConfig()
  validation: ValidationConfig = ValidationConfig()
  checkpoint: CheckpointConfig = CheckpointConfig()
  seed: int = 0
  total_steps: int = 1000
  shuffle: bool = True
  log_every: int = 1
  tensorboard: bool = True
  wandb: WandbConfig = WandbConfig()
  progress_bar: bool = True

  def __post_init__(self):
    if not isinstance(self.objective, Objective):
      _fail("train", "objective", self.objective, "must be an Objective")
    if self.total_steps < 1:
      _fail("train", "total_steps", self.total_steps, "must be >= 1")
    if self.log_every < 1:
      _fail("train", "log_every", self.log_every, "must be >= 1")
    self.objective.check_replay(self.replay.fraction)
    g, k = self.rollout.group_size, self.replay_rows
    top = g if self.replay.mode == "add" else g - 1
    if self.replay.enabled and not 1 <= k <= top:
      _fail("replay", "fraction", self.replay.fraction,
            f"must replay between 1 and {top} samples of a group of {g} (gives {k})")
    rc, rows = self.rollout, self.rollout.prompts_per_batch * self.rows_per_prompt
    if rows % rc.num_minibatches:
      _fail("rollout", "num_minibatches", rc.num_minibatches,
            f"must divide the {rows} rows of a step ({rc.prompts_per_batch} prompts x "
            f"{self.rows_per_prompt} rows)")
    if self.objective.group_relative and self.rows_per_prompt < 2:
      _fail("rollout", "group_size", self.rollout.group_size,
            f"must be >= 2 for objective {self.objective.name!r}: "
            f"{self.objective.group_relative}, and a group of one row has nothing to be relative "
            "to (every row's signal would be 0)")

  @property
  def replay_rows(self) -> int:
    """k: the replayed rows of a prompt's group at the start of the run."""
    return int(round(self.replay.fraction * self.rollout.group_size))

  @property
  def rows_per_prompt(self) -> int:
    """G, or G + k when replayed rows are added."""
    add = self.replay.enabled and self.replay.mode == "add"
    return self.rollout.group_size + (self.replay_rows if add else 0)

  @property
  def work(self) -> tuple[int, bool]:
    """(sequences the run trains on: steps x prompts x rows per prompt, whether the objective's
    trainable state adds a pass of its own): what a job orders its runs by, longest first."""
    sequences = self.total_steps * self.rollout.prompts_per_batch * self.rows_per_prompt
    return sequences, bool(self.objective.has_state)

  @property
  def needs(self) -> Needs:
    """What the objective reads under this run's rollout settings (`Objective.needs`)."""
    return self.objective.needs(self.rollout)

  @property
  def old_logp_in_update(self) -> bool:
    """Whether pi_old comes from the update's own forward: one on-policy update per batch,
    recomputed pi_old, and nothing reads it on the host first (a batch log Z, or TB's behaviour
    log-probs of stale rollouts)."""
    return self.needs.old_logp == "update"

  @property
  def total_updates(self) -> int:
    """The optimizer updates of the whole run: ``total_steps * rollout.num_minibatches``."""
    return self.total_steps * self.rollout.num_minibatches
