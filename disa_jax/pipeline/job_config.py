"""The main job's config, typed (`configs/main.py` converted once by `MainConfig.from_config`): the
workflows' own config sections with `JOB_PATH` in their path fields, the Stage 3 runs (`RunSpec`)
and the job's own sections (task, tracking, end state, endpoints, held-out prompts, the tiny
models). `disa_jax.pipeline.sum_job.SumJob` derives every stage's config from it."""
from __future__ import annotations

import dataclasses
import math
import typing
from typing import Any, Mapping

from disa_jax import config as config_lib
from disa_jax.eval import wrong_answers
from disa_jax.pipeline.claims import parse_comparison
from disa_jax.pipeline.dynamics import EndStateConfig
from disa_jax.pipeline.endpoints import EndpointsConfig
from disa_jax.pipeline.heldout import HeldoutConfig
from disa_jax.pipeline.sum_models import TinyLMSpec, WarmupSpec
from disa_jax.rl.config import ReplayConfig, TrainConfig
from disa_jax.rl.objectives import Objective
from disa_jax.rl.replay import replay_count
from disa_jax.rollout.engines import EngineConfig
from disa_jax.sft.baseline import LoRASFTConfig
from disa_jax.tasks.sum import SumTask
from disa_jax.workflows.evaluation import EvalConfig
from disa_jax.workflows.stage1 import Stage1Config
from disa_jax.workflows.stage2 import Stage2Config

ANCHORS = ("fitted", "exact", "exact+noise")
STAGES = ("all", "anchor")  # `MainConfig.stages`
# The value of every path field in `MainConfig`'s workflow sections: `SumJob` sets the real paths
# (under its workdir) when it derives each stage's config.
JOB_PATH = "<set by SumJob>"
_JOB_PATHS = {
    "stage1": dict(prompts_path=JOB_PATH, reference_path=JOB_PATH, proposal_path=JOB_PATH,
                   output_dir=JOB_PATH),
    "stage2": dict(stage1_path=JOB_PATH, reference_path=JOB_PATH, anchor_path=JOB_PATH,
                   output_dir=JOB_PATH),
    "eval": dict(output_dir=JOB_PATH, model_path=JOB_PATH, benchmarks={"task": JOB_PATH}),
}


# A run's config keys that override one field of its train section each (`RunSpec.from_config`):
# key -> (the field's dotted path, its type); 0 (the default) keeps the job's value.
RUN_TRAIN_KEYS = {
    "minibatches": ("train.rollout.num_minibatches", int),  # optimizer updates per rollout batch
    "staleness": ("train.rollout.max_staleness", int),  # asynchronous rollouts (rl.async_rollout)
    "lr": ("train.optim.lr", float),  # the peak learning rate
}
_SET_BY_RUN = ("objective", "replay", "seed")  # train fields every run sets from its own spec


def _train_field(path: str) -> type:
  """The type of the scalar field of `TrainConfig` at ``path`` ('train.rollout.num_minibatches');
  raises naming the path when there is none (or a run sets it itself)."""
  head, *parts = path.split(".")
  cls, hint = TrainConfig, None
  if head != "train" or not parts or parts[0] in _SET_BY_RUN:
    own = ", ".join(f"train.{f}" for f in _SET_BY_RUN)
    raise ValueError(f"overrides: {path!r} is not a field of the train section a run may override "
                     f"('train.<section>.<field>'; not {own}, which the run's own fields set)")
  for i, part in enumerate(parts):
    hint = typing.get_type_hints(cls).get(part) if dataclasses.is_dataclass(cls) else None
    if hint is None or (i < len(parts) - 1 and not dataclasses.is_dataclass(hint)):
      raise ValueError(f"overrides: the train section has no field {path!r}")
    cls = hint
  if hint not in (int, float, str, bool):
    raise ValueError(f"overrides: {path!r} is a section, not a field (int, float, str or bool)")
  return hint


def _is_float_field(path: str) -> bool:
  try:
    return _train_field(path) is float
  except ValueError:  # (RunSpec's own check names the path)
    return False


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunSpec:
  """One Stage 3 run of the main job: an objective, its Stage 1 replay (`ReplayConfig`: the run's
  ``train.replay`` section, reading the job's Stage 1 file), its anchor, and ``match_rows_of``: the
  name of a run with replay mode 'add' whose G + k rows per prompt this run samples on-policy (its
  ``rollout.group_size``; the compute-matched control of that run), '' = the job's G.

  ``anchor``: 'fitted' (Stage 2), 'exact' (the exact log Z) or 'exact+noise' (the exact log Z plus
  per-prompt offsets of RMS exactly ``sigma``, seeded by the job's seed: `disa_jax.anchor.noise`).
  ``overrides``: fields of the job's train section this run trains with, by dotted path
  (``{'train.rollout.num_minibatches': 4}``; `MainConfig.run_train`); in the config, the keys of
  `RUN_TRAIN_KEYS` (``minibatches``, ``staleness``, ``lr``: 0 keeps the job's) declare them.
  ``seeds``: this run's Stage 3 seeds, () = the job's
  (`MainConfig.run_seeds`): a grid runs several seeds only where a comparison is decided.
  ``data_seed``: the Stage 1/2 replicate the run reads its fitted anchor and replay pool from: 0 =
  the job's (``stage1/``, ``anchor/``); d > 0 = Stage 1 drawn again with sampling seed + d and
  Stage 2 fitted on it with fit seed + d (``stage1_data<d>/``, ``anchor_data<d>/``: `SumJob.replicas`).
  """
  objective: Objective
  replay: ReplayConfig = ReplayConfig()
  anchor: str = "fitted"
  match_rows_of: str = ""
  sigma: float = 0.0
  overrides: dict[str, int | float | str | bool] = dataclasses.field(default_factory=dict)
  seeds: tuple[int, ...] = ()
  data_seed: int = 0

  def __post_init__(self):
    if self.anchor not in ANCHORS:
      raise ValueError(f"anchor must be one of {ANCHORS}, got {self.anchor!r}")
    if self.anchor != "fitted" and not self.objective.needs_anchor:
      raise ValueError(f"anchor={self.anchor!r} is set but objective {self.objective.name!r} uses "
                       "no anchor")
    if self.match_rows_of and self.replay.enabled:
      raise ValueError(f"match_rows_of={self.match_rows_of!r} samples every row on-policy, but the "
                       f"run replays (replay.fraction={self.replay.fraction})")
    if (self.anchor == "exact+noise") != (self.sigma != 0):
      raise ValueError(f"sigma must be > 0 with anchor='exact+noise' and 0 otherwise, got "
                       f"sigma={self.sigma!r} with anchor={self.anchor!r}")
    if self.sigma < 0:
      raise ValueError(f"sigma must be >= 0, got sigma={self.sigma!r}")
    for path, value in self.overrides.items():
      want = _train_field(path)
      if type(value) is not want or (want is float and not math.isfinite(value)):
        raise ValueError(f"overrides[{path!r}] must be {want.__name__}"
                         f"{' (finite)' if want is float else ''}, got {value!r}")
    if len(set(self.seeds)) != len(self.seeds):
      raise ValueError(f"seeds must be distinct (() = the job's), got {self.seeds!r}")
    if not (isinstance(self.data_seed, int) and self.data_seed >= 0):
      raise ValueError(f"data_seed must be an int >= 0 (0 = the job's Stage 1/2), got "
                       f"{self.data_seed!r}")

  @property
  def reads_stage12(self) -> bool:
    """Whether the run's result depends on the job's Stage 1/2 draw: its fitted anchor, its replay
    pool, or (an 'exact+noise' anchor) the draw of the noise, seeded with the data seed too."""
    return ((self.objective.needs_anchor and self.anchor in ("fitted", "exact+noise"))
            or self.replay.enabled)

  @classmethod
  def from_config(cls, value: Any, where: str = "runs") -> "RunSpec":
    """From a run's config section: its `RUN_TRAIN_KEYS` (each an int / float >= 0; 0 keeps the
    job's) become ``overrides`` entries, the other keys are the fields (`config.from_mapping`);
    an int given for a float field of ``overrides`` is read as a float, as any config field."""
    raw = dict(value.to_dict() if hasattr(value, "to_dict") else value)
    overrides = {path: float(v) if isinstance(v, int) and not isinstance(v, bool)
                 and _is_float_field(path) else v
                 for path, v in _dotted(dict(raw.pop("overrides", None) or {})).items()}
    for key, (path, kind) in RUN_TRAIN_KEYS.items():
      v = raw.pop(key, 0)
      if (isinstance(v, bool) or not isinstance(v, (int, float) if kind is float else int)
          or not math.isfinite(v) or v < 0):
        raise ValueError(f"{where}.{key} must be {'a number' if kind is float else 'an int'} >= 0 "
                         f"(0 = the job's {path}), got {v!r}")
      if v and path in overrides:
        raise ValueError(f"{where}: {key}={v!r} and overrides[{path!r}] set one field twice")
      if v:
        overrides[path] = kind(v)
    return config_lib.from_mapping(cls, raw | {"overrides": overrides}, where)


Override = int | float | str | bool  # a run's train override (`RunSpec.overrides`)


def _dotted(tree: Mapping[str, "Override | Mapping"], prefix: str = "") -> dict[str, Override]:
  """``overrides`` as dotted paths: {'train': {'optim': {'grad_clip': 0.0}}} (what a ConfigDict can
  hold: it refuses dotted keys) -> {'train.optim.grad_clip': 0.0}; dotted keys pass through."""
  out: dict[str, Override] = {}
  for key, v in tree.items():
    path = f"{prefix}{key}"
    out.update(_dotted(v, path + ".") if isinstance(v, dict) else {path: v})
  return out


REPLICA_TAG = "_rep"


def replica_run(cell: str, d: int) -> str:
  """The name of cell ``cell``'s run on anchor replica ``d`` > 0 (`MainConfig.anchor_replicas`)."""
  return f"{cell}{REPLICA_TAG}{d}"


def _is_replica(name: str) -> bool:
  head, tag, d = name.rpartition(REPLICA_TAG)
  return bool(head and tag and d.isdigit())


def replace_paths(obj: Any, changes: Mapping[str, Any]) -> Any:
  """``dataclasses.replace`` of ``obj``'s nested fields by dotted path (``{'seed': 1,
  'rollout.group_size': 12}``): each section replaced once, with all its changes (so validated
  once, as a whole)."""
  direct, nested = {}, {}
  for path, value in changes.items():
    head, _, rest = path.partition(".")
    if rest:
      nested.setdefault(head, {})[rest] = value
    else:
      direct[head] = value
  direct |= {head: replace_paths(getattr(obj, head), sub) for head, sub in nested.items()}
  return dataclasses.replace(obj, **direct)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TaskConfig:
  """The sum task: prompts n = n_min..n_max, responses of at most ``max_tokens`` tokens."""
  n_min: int = 0
  n_max: int = 40
  max_tokens: int = 8

  def __post_init__(self):
    SumTask(self.n_min, self.n_max)  # validates the range
    if self.max_tokens < 6:
      raise ValueError(f"max_tokens must be >= 6 (the longest correct answer), got "
                       f"{self.max_tokens!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class AnchorStudyConfig:
  """The sigma_g study of sharper anchors: ``repeats`` per N (0 = off), ``folds`` of the split."""
  repeats: int = 8
  folds: int = 5

  def __post_init__(self):
    if self.repeats < 0 or self.folds < 2:
      raise ValueError(f"anchor_study needs repeats >= 0 and folds >= 2, got {self.repeats}, "
                       f"{self.folds}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class NStudyRunSpec:
  """The App. C.3 command (`disa_jax.workflows.nstudy`) on the sum task: a stratified subset of
  ``subset_size`` prompts (k at the elbow of ``ks``), a fresh Stage 1 pool of ``pool_size`` samples
  per prompt, ``repeats`` subsamples of each M in `MainConfig.n_study`; off when not ``enabled``."""
  enabled: bool = True
  subset_size: int = 20
  pool_size: int = 32
  repeats: int = 64
  ks: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7, 8)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrackConfig:
  """Exact measures during Stage 3: every ``every`` steps (0 = off), ``kl_samples`` policy samples
  per prompt for the Monte Carlo KL, ``wrong_samples`` samples of the policy conditioned on a wrong
  answer per prompt for the decomposition's wrong-answer term (0 = from the plain samples;
  `Stage3Config.exact_target`); with ``heldout`` the held-out prompts too (``exact_heldout/*``;
  needs ``heldout.fraction`` > 0); with ``every_before_window`` every that many steps until the
  end-state window and every ``every`` in it (`cadence`); with ``start_every`` (issue 62) at step 0
  (the initial policy) and every that many steps over the first ``start_share`` of the run, then
  every ``every``, so that a steps-to-level endpoint is rarely left-censored (with both, three
  phases: the dense start, the sparse middle, the dense window). ``share_prompts``,
  ``wrong_decode`` and ``scorer_rows``: the tracker's implementation (`ExactTargetConfig`'s fields
  of those names: the same measures up to float32 rounding; the first two 0.41x the seconds per
  measurement together on the anchor testbed, benchmarks/results/exact_tracker_speed_cpu.json)."""
  every: int = 100
  kl_samples: int = 16
  heldout: bool = False
  wrong_samples: int = 0
  every_before_window: int = 0
  share_prompts: bool = False
  wrong_decode: str = "full"
  scorer_rows: int = 64
  start_every: int = 0
  start_share: float = 0.1

  def __post_init__(self):
    if self.every < 0 or self.kl_samples < 2:
      raise ValueError(f"track needs every >= 0 and kl_samples >= 2, got {self.every}, "
                       f"{self.kl_samples}")
    if self.wrong_samples != 0 and self.wrong_samples < 2:
      raise ValueError(f"track.wrong_samples must be 0 (off) or >= 2, got {self.wrong_samples!r}")
    if self.wrong_decode not in wrong_answers.DECODES:
      raise ValueError(f"track.wrong_decode must be one of {wrong_answers.DECODES}, got "
                       f"{self.wrong_decode!r}")
    if self.scorer_rows < 1:
      raise ValueError(f"track.scorer_rows must be >= 1, got {self.scorer_rows!r}")
    if self.every_before_window < 0 or (self.every_before_window and not self.every):
      raise ValueError(f"track.every_before_window must be 0 (off), or > 0 with track.every > 0, "
                       f"got {self.every_before_window!r} (track.every={self.every})")
    if self.start_every < 0 or (self.start_every and not self.every):
      raise ValueError(f"track.start_every must be 0 (off), or > 0 with track.every > 0, got "
                       f"{self.start_every!r} (track.every={self.every})")
    if not 0 < self.start_share <= 1:
      raise ValueError(f"track.start_share must be in (0, 1], got {self.start_share!r}")

  def cadence(self, total_steps: int, end_state: EndStateConfig) -> dict[str, int | bool]:
    """Stage 3's ``validation`` fields for a run of ``total_steps``: ``every``, and with
    ``every_before_window`` that sparser cadence until the last multiple of ``every`` at or before
    the start of the end-state window over the measured steps (`EndStateConfig.window_start`), so
    the window holds the dense measurements only (none, where that leaves no sparse step); with
    ``start_every``, step 0 and every ``start_every`` steps up to ``start_share`` of the run."""
    out: dict[str, int | bool] = {"every": self.every}
    until = max(int(round(self.start_share * total_steps)), 1)
    early = self.every_before_window
    if self.start_every and not early:  # two phases: dense start, then every
      return out | {"at_start": True, "early_every": self.start_every, "dense_from": until + 1}
    if not early:
      return out
    last = total_steps - total_steps % self.every
    first = 0 if self.start_every else early  # step 0 is measured with a dense start
    dense_from = int(end_state.window_start(first, last) // self.every) * self.every
    out |= {"early_every": early, "dense_from": dense_from} if dense_from > early else {}
    if self.start_every:  # three phases: dense start, sparse middle, dense end
      out |= {"at_start": True, "start_every": self.start_every, "start_until": until}
    return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class MainConfig:
  """`configs/main.py`, typed: converted once (`from_config`) and validated once.

  Roles are data: ``fix`` (the shipped variant whose claims the report checks), ``disa`` (the
  paper's DISA) and ``oracle`` (DISA on the exact log Z) name runs of ``runs`` ('' = none); a role
  whose run is not in ``methods`` is not played (`plan.JobPlan`).

  ``stage1`` / ``stage2`` / ``eval`` are the workflows' own configs, ``train`` Stage 3's
  `TrainConfig` (its ``objective`` is replaced by each run's) and ``sft`` run_sft's
  `LoRASFTConfig`. Their path fields hold `JOB_PATH`: `SumJob` derives each stage's config from
  them with `dataclasses.replace` (paths under its workdir, the job's beta, seeds and engine).
  ``eval_workers``: processes the evaluation rows are split over (each with its own engine; a
  row's results do not depend on the process or the rows before it). ``pin_workers``: each
  Stage 3 and evaluation worker process runs on its own share of the job's CPUs
  (`job_workers.spawn_pool`; results unchanged, less wall time where the workers fill the CPUs).
  ``seed_batch``: the most
  Stage 3 seeds of one run trained together, as one batch dimension in one process
  (`disa_jax.rl.seed_batch`; 1 = each seed a run of its own). ``stages``: 'all', or 'anchor' (the
  models, Stages 1-2 and the anchor study, then `stage12.write_anchor_report`).
  ``compilation_cache``: the job's processes share a persistent compilation cache in
  ``<workdir>/jax_cache`` (`disa_jax.runtime.persistent_compilation_cache`; a cache directory in
  the environment wins), so each Stage 3 run after the first of its shapes loads its programs.
  ``rebuild_models``: train pi_ref and p_T on this machine instead of copying the pinned ones
  (`pipeline.pinned`; where none are pinned they are trained either way).
  ``anchor_replicas``: R independent Stage 1-2 replicas (issue 62: the anchor's error as a random
  factor). With R > 1 every run of ``methods`` that reads the Stage 1/2 draw (`RunSpec.reads_stage12`)
  is a cell run on each replica d = 0..R-1: the run itself on d = 0 and `replica_run` names on
  d > 0, each the same spec with ``data_seed`` d (its own Stage 1 sampling seed, Stage 2 fit seed and
  noise draw) and the same Stage 3 seeds, nested within it (added to ``runs`` and ``methods`` here).
  The analysis unit of such a cell is the replica's mean over its Stage 3 seeds
  (`plan.replica_units`).
  ``attention_impl``: the attention of Stage 3's policy and reference (their `BackboneConfig`;
  `disa_jax.config.ATTENTION_IMPLS`): 'auto' runs the job's short rows dense on a CPU.
  """
  preset: str = "default"
  seed: int = 0
  beta: float = 15.0
  engine: EngineConfig = EngineConfig(kind="jax", dtype="float32")
  methods: tuple[str, ...] = ("disa", "flowrl", "grpo", "gspo")
  seeds: tuple[int, ...] = (0,)
  stage3_workers: int = 1
  eval_workers: int = 1
  pin_workers: bool = True
  seed_batch: int = 1
  stages: str = "all"
  compilation_cache: bool = True
  rebuild_models: bool = False
  anchor_replicas: int = 1
  attention_impl: str = "auto"
  runs: dict[str, RunSpec] = dataclasses.field(default_factory=dict)
  fix: str = ""
  disa: str = ""
  oracle: str = ""
  controls: tuple[str, ...] = ()
  compare: tuple[str, ...] = ()
  track: TrackConfig = TrackConfig()
  end_state: EndStateConfig = EndStateConfig()
  endpoints: EndpointsConfig = EndpointsConfig()
  sft_enabled: bool = True
  conditional_kl: bool = False
  heldout: HeldoutConfig = HeldoutConfig()
  task: TaskConfig = TaskConfig()
  arch: TinyLMSpec = TinyLMSpec()
  reference_model: WarmupSpec = WarmupSpec(correct_frac=0.6, skew=1.0, steps=1200, seed=0)
  proposal_model: WarmupSpec = WarmupSpec(correct_frac=0.95, skew=0.85, steps=400, seed=1)
  n_study: tuple[int, ...] = (2, 4, 8, 16)
  n_study_repeats: int = 64
  anchor_study: AnchorStudyConfig = AnchorStudyConfig()
  nstudy: NStudyRunSpec = NStudyRunSpec()
  stage1: Stage1Config = Stage1Config(**_JOB_PATHS["stage1"])
  stage2: Stage2Config = Stage2Config(**_JOB_PATHS["stage2"])
  train: TrainConfig = TrainConfig()
  sft: LoRASFTConfig = LoRASFTConfig()
  eval: EvalConfig = EvalConfig(**_JOB_PATHS["eval"])

  def __post_init__(self):
    if not self.beta > 0:
      raise ValueError(f"beta must be > 0, got {self.beta!r}")
    config_lib.check_attention_impl(self.attention_impl)
    self._add_replicas()
    unknown = [m for m in self.methods if m not in self.runs]
    if not self.methods or unknown:
      raise ValueError(f"methods must be a non-empty subset of runs {sorted(self.runs)}, got "
                       f"{self.methods!r}")
    if self.fix and self.fix not in self.runs:
      raise ValueError(f"fix must name one of runs {sorted(self.runs)} (or be ''), got {self.fix!r}")
    for role in ("disa", "oracle"):
      if getattr(self, role) and getattr(self, role) not in self.runs:
        raise ValueError(f"{role} must name one of runs {sorted(self.runs)} (or be ''), got "
                         f"{getattr(self, role)!r}")
    bad = [c for c in self.controls if c not in self.runs or c == self.fix]
    if bad or (self.controls and not self.fix):
      raise ValueError(f"controls must name runs {sorted(self.runs)} other than the fix "
                       f"{self.fix!r} (which must be set), got {self.controls!r}")
    pairs = {}
    for i, pair in enumerate(self.compare):
      a, b, _ = parse_comparison(pair, f"compare[{i}]")
      if not (a in self.methods and b in self.methods):
        raise ValueError(f"compare[{i}] must be 'A<B' or 'A<>B' with both runs in methods "
                         f"{list(self.methods)}, got {pair!r}")
      if frozenset((a, b)) in pairs:  # one hypothesis per pair, its direction declared once
        raise ValueError(f"compare[{i}] = {pair!r} tests the pair of "
                         f"{pairs[frozenset((a, b))]!r} again; declare each pair once ('A<B', or "
                         "'A<>B' for either direction)")
      pairs[frozenset((a, b))] = pair
    for name, spec in self.runs.items():
      other = self.runs.get(spec.match_rows_of)
      if spec.match_rows_of and (other is None or other.replay.mode != "add"
                                 or not other.replay.enabled):
        raise ValueError(f"runs.{name}.match_rows_of must name a run with replay mode 'add', got "
                         f"{spec.match_rows_of!r}")
    if not self.seeds or len(set(self.seeds)) != len(self.seeds):
      raise ValueError(f"seeds must be distinct ints, at least one, got {self.seeds!r}")
    for m in self.methods:  # a run's own seeds name its runs after the job's first seed
      if self.runs[m].seeds and self.runs[m].seeds[0] != self.seeds[0]:
        raise ValueError(f"runs.{m}.seeds must start with the job's first seed {self.seeds[0]} "
                         f"(its unsuffixed run), got {self.runs[m].seeds!r}")
    if self.stages not in STAGES:
      raise ValueError(f"stages must be one of {STAGES}, got {self.stages!r}")
    if self.endpoints.pairs(self.methods) and not self.track.every:
      raise ValueError(f"endpoints.compare={self.endpoints.compare!r} reads the exact measures: "
                       "it needs track.every > 0, got 0")
    if self.endpoints.pilot_runs(self.methods) and not self.track.every:
      raise ValueError(f"endpoints.step_size={self.endpoints.step_size!r} reads the exact "
                       "measures: it needs track.every > 0, got 0")
    if self.track.heldout and not self.heldout.enabled:
      raise ValueError("track.heldout=True measures the held-out prompts: it needs "
                       f"heldout.fraction > 0, got {self.heldout.fraction!r}")
    for name in ("stage3_workers", "eval_workers", "seed_batch"):
      if not (isinstance(getattr(self, name), int) and getattr(self, name) >= 1):
        raise ValueError(f"{name} must be an int >= 1, got {getattr(self, name)!r}")
    if self.n_study_repeats < 1 or not all(m >= 1 for m in self.n_study):
      raise ValueError(f"n_study values and n_study_repeats must be >= 1, got {self.n_study}, "
                       f"{self.n_study_repeats}")

  def replicated(self) -> dict[str, tuple[str, ...]]:
    """{cell: its run per replica d = 0..R-1} for each replicated cell ({} with R = 1)."""
    if self.anchor_replicas == 1:
      return {}
    return {m: (m, *(replica_run(m, d) for d in range(1, self.anchor_replicas)))
            for m in self.methods if m in self.runs and self.runs[m].data_seed == 0
            and self.runs[m].reads_stage12 and not _is_replica(m)}

  def _add_replicas(self) -> None:
    """With ``anchor_replicas`` > 1, the replica runs of every replicated cell in ``runs`` and in
    ``methods`` after their cell (idempotent: a converted config converts again unchanged)."""
    if not (isinstance(self.anchor_replicas, int) and self.anchor_replicas >= 1):
      raise ValueError(f"anchor_replicas must be an int >= 1, got {self.anchor_replicas!r}")
    cells = self.replicated()
    if not cells:
      return
    runs, methods = dict(self.runs), []
    for m in self.methods:
      methods += [m] if m not in cells else [r for r in cells[m] if r not in methods]
      for d, name in enumerate(cells.get(m, ())[1:], start=1):
        if name in self.runs and self.runs[name] != dataclasses.replace(self.runs[m], data_seed=d):
          raise ValueError(f"runs.{name} is anchor replica {d} of {m!r}'s name but another run")
        runs[name] = dataclasses.replace(self.runs[m], data_seed=d)
    object.__setattr__(self, "runs", runs)  # (frozen: set once, before any reader)
    object.__setattr__(self, "methods", tuple(dict.fromkeys(methods)))

  def run_seeds(self, method: str) -> tuple[int, ...]:
    """The Stage 3 seeds of run ``method``: its own `RunSpec.seeds`, else the job's."""
    return self.runs[method].seeds or self.seeds

  def run_train(self, method: str, seed: int, progress_bar: bool | None = None) -> TrainConfig:
    """The ``train`` section as run ``method`` trains at Stage 3 seed ``seed``: the run's objective
    (at the job's beta, which the anchors' labels use too), replay, seed, the job's tracking, the
    rows of the run it matches (``match_rows_of``) and its `RunSpec.overrides`; ``progress_bar``
    None keeps the section's."""
    spec, t = self.runs[method], self.train
    obj = spec.objective
    if any(f.name == "beta" for f in dataclasses.fields(obj)):
      obj = dataclasses.replace(obj, beta=self.beta)
    changes: dict[str, Any] = {"objective": obj, "seed": seed, "replay": spec.replay}
    if progress_bar is not None:
      changes["progress_bar"] = progress_bar
    if spec.match_rows_of:  # G + k on-policy rows: the rows per prompt of the run it matches
      g, matched = t.rollout.group_size, self.runs[spec.match_rows_of]
      changes["rollout.group_size"] = g + replay_count(matched.replay.fraction, g)
    steps = spec.overrides.get("train.total_steps", t.total_steps)
    changes |= {f"validation.{k}": v for k, v in self.track.cadence(steps, self.end_state).items()}
    changes |= {path.removeprefix("train."): v for path, v in spec.overrides.items()}
    return replace_paths(t, changes)

  @classmethod
  def from_config(cls, config: Any) -> "MainConfig":
    """From `configs/main.py`'s ConfigDict (or a dict): its sections hold no paths, so the
    workflow configs' required path fields are set to `JOB_PATH` before the one conversion;
    errors name the dotted field (``stage1.sampling.temperature``, ``runs.disa.objective.beta``)."""
    raw = dict(config.to_dict() if hasattr(config, "to_dict") else config)
    hints = typing.get_type_hints(cls)
    for name, paths in _JOB_PATHS.items():  # (from_mapping itself: not the workflows' from_config)
      section = raw.get(name, {})
      section = dict(section.to_dict() if hasattr(section, "to_dict") else section, **paths)
      raw[name] = config_lib.from_mapping(hints[name], section, name)
    return config_lib.from_mapping(cls, raw)
