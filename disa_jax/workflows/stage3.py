"""The Stage 3 command: DISA / FlowRL / GRPO / GSPO training from a backbone, end to end.

`run_stage3(Stage3Config)` loads the policy (initialised from the backbone, pi_ref's weights) and
the frozen reference on the training mesh, the training prompts (tokenised by
`disa_jax.data.prompting.encode_prompt` under the run's rendering, as Stages 1 and 2 did), the
registered reward, the frozen anchor (checked against the objective and against the reference model
and rendering it was fitted on) and the Stage 1 replay pool when asked for, starts the rollout
engine (one generation process per host), runs the `Trainer`, and exports the final policy as a
Hugging Face directory. Run directory:

    config.json        the resolved config (process 0)
    metrics.jsonl, tb/ per-step metrics
    checkpoints/<s>/   orbax checkpoints; a rerun resumes from the latest
    final/             the exported policy (`workflows.export`), with ``export_info.json``: the best
                       checkpoint by validation unless ``export_checkpoint`` says otherwise
                       (`disa_jax.checkpoint.selection`; the summary and the log say which and why)

SIGTERM / SIGUSR1 save a checkpoint at the next step boundary and return a summary with
``preempted`` set (no export); the command then exits 0 (`disa_jax.preemption`), start-up included
(before the engine starts: nothing new to save). A rerun with the same ``workdir`` resumes; one
whose checkpoint comes from another config or model stops at once, naming the field that differs.
``identity.json`` records the inputs' paths and content hashes (policy, reference, prompt / anchor /
replay / validation files; compared by content, so a workdir copied with its inputs to other paths
resumes), the model and data settings and the training fields that change what a step computes,
``train.total_steps`` included (it places the learning rate's decay phase;
`disa_jax.rl.run_state.IDENTITY_FIELDS`): a rerun with other values stops naming every differing
field, or with ``overwrite=True`` deletes the checkpoints, metrics and export and starts afresh
(`disa_jax.checkpoint.identity`; an identity.json older than the training fields is completed from
the latest checkpoint's config). Process 0 holds ``<workdir>/.lock`` for the run (a second run gets
`OutputLockedError`).
"""
from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from disa_jax import anchor as anchor_lib
from disa_jax import artifacts, codec
from disa_jax import config as config_lib
from disa_jax import models, preemption, rewards, tasks
from disa_jax.checkpoint import identity, selection
from disa_jax.checkpoint.files import naming
from disa_jax.checkpoint.lock import owned_output
from disa_jax.data.prompting import check_rendering, encode_prompt
from disa_jax.data.tokenizer import load_tokenizer
from disa_jax.eval.exact import ExactTargetConfig
from disa_jax.parallel import distributed
from disa_jax.parallel.mesh import MeshConfig
from disa_jax.rl.config import RolloutConfig, TrainConfig
from disa_jax.rl.prompts import PromptItem
from disa_jax.rl.replay import ReplayPool
from disa_jax.rl.build import build_trainer, validate_anchor
from disa_jax.rl.inputs import AnchorInput, EngineLink, RolloutTask, StepModels
from disa_jax.rl.run_state import recorded_train_identity, train_identity
from disa_jax.rollout import stop_ids
from disa_jax.rollout.engines import EngineConfig, generation_env
from disa_jax.rollout.types import MODEL_ENGINES
from disa_jax.tasks.prompts import load_prompts
from disa_jax.tasks.registry import import_reward_plugins
from disa_jax.workflows import export
from disa_jax.workflows.export import EXPORT_DTYPES
from disa_jax.workflows.pinned_prompts import check_stage1_prompts

DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True, kw_only=True)
class BackboneConfig:
  """The models of a Stage 3 run.

  Attributes:
    policy_path: local HF directory of the initial policy (pi_ref's weights; Alg. 1 line 9).
    reference_path: local HF directory of pi_ref ('' = policy_path).
    dtype: computation dtype of the forward / backward passes.
    param_dtype: storage dtype of the trained policy (the AdamW master copy).
    remat: recompute decoder layers in the backward pass.
    remat_policy: what a recomputed layer keeps (`disa_jax.config.REMAT_POLICIES`; 'full' = nothing;
      `disa_jax.models.transformer.remat_policy`).
    scan_unroll: unroll of the scan over decoder layers (num_layers = fully unrolled).
    attention_chunk: attention query block of the policy and the reference (0 = no chunking: the
      implementation's own query blocks; c > 0 = blocks of c queries whose probabilities the
      backward pass recomputes, `[heads, c, keys]` at a time; `disa_jax.models.Transformer`);
      'xla' / 'dense' attention only.
    attention_impl: the attention of the policy and the reference over packed rows
      (`disa_jax.config.ATTENTION_IMPLS`; 'auto' = 'dense' for rows of <= 256 tokens and 'xla'
      for longer ones on a CPU, 'cudnn' on a GPU, 'splash' on a TPU;
      `disa_jax.models.attention_dispatch`). Both models are told that a row holds at most
      ``rollout.seqs_per_row`` sequences (cuDNN's packed layout) and that no segment is longer
      than `RolloutConfig.max_segment_len` (the 'xla' band; the packing refuses a longer one).
  """
  policy_path: str = ""
  reference_path: str = ""
  dtype: str = "bfloat16"
  param_dtype: str = "float32"
  remat: bool = True
  remat_policy: str = "full"
  scan_unroll: int = 1
  attention_chunk: int = 0
  attention_impl: str = "auto"

  def __post_init__(self):
    config_lib.check_attention_chunk(self.attention_chunk, "model.attention_chunk")
    config_lib.check_attention_impl(self.attention_impl, "model.attention_impl")
    config_lib.check_remat_policy(self.remat_policy, "model.remat_policy")
    for f in ("dtype", "param_dtype"):
      if getattr(self, f) not in DTYPES:
        raise ValueError(f"model.{f} must be one of {DTYPES}, got {getattr(self, f)!r}")
    if self.scan_unroll < 1:
      raise ValueError(f"model.scan_unroll must be >= 1, got {self.scan_unroll!r}")

  @property
  def reference(self) -> str:
    return self.reference_path or self.policy_path


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
  """What a Stage 3 run trains on.

  Attributes:
    train_path: training prompts (veRL parquet / jsonl, or a benchmark file).
    prompts_format: loader format ('auto' | 'verl' | a benchmark format of `disa_jax.data`).
    reward: registered reward name ('math' | 'code' | 'sum_task' | a plugin's).
    reward_plugins: modules imported first that register further rewards.
    rendering: 'chat_template' | 'plain' (`disa_jax.data.prompting`); the anchor must match.
    anchor_path: the frozen Stage 2 anchor (objectives whose `Needs` has ``anchor``).
    replay_path: the Stage 1 dataset replayed when ``train.replay.fraction > 0``.
    validation_paths: held-out prompt files for periodic validation (``train.validation``).
  """
  train_path: str = ""
  prompts_format: str = "auto"
  reward: str = "math"
  reward_plugins: tuple[str, ...] = ()
  rendering: str = "chat_template"
  anchor_path: str = ""
  replay_path: str = ""
  validation_paths: tuple[str, ...] = ()

  def __post_init__(self):
    check_rendering(self.rendering, "data.rendering")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Stage3Config:
  """A Stage 3 command (`configs/stage3_base.py` documents every field).

  Attributes:
    workdir: the run directory (metrics, checkpoints, the exported policy).
    model, data, engine, mesh: the models, data, rollout engine and training mesh.
    train: what the `Trainer` reads (`disa_jax.rl.config.TrainConfig`).
    exact_target: every ``train.validation.every`` steps, the exact measures against the tilted
      target (P(correct), entropy over correct, KL and its decomposition; `disa_jax.eval.exact`) on
      the validation prompts (the training prompts when there are none), for a task whose correct
      set can be enumerated (its `disa_jax.tasks` ``measures`` hook); off unless
      ``exact_target.reference_path`` is set.
    export: write the final policy to ``<workdir>/final`` as an HF directory.
    export_checkpoint: which checkpoint ``final`` holds: 'best' (by validation; the latest when
      the run never validated), 'latest' or a step number.
    export_dtype: storage dtype of that export ('bfloat16' | 'float32').
  """
  workdir: str = ""
  model: BackboneConfig = BackboneConfig()
  data: DataConfig = DataConfig()
  engine: EngineConfig = EngineConfig()
  mesh: MeshConfig = MeshConfig()
  train: TrainConfig = TrainConfig()
  exact_target: ExactTargetConfig = ExactTargetConfig()
  export: bool = True
  export_checkpoint: str = "best"
  export_dtype: str = "bfloat16"
  overwrite: bool = False

  def __post_init__(self):
    selection.check_which(self.export_checkpoint, "export_checkpoint")
    if self.export_dtype not in EXPORT_DTYPES:
      raise ValueError(f"export_dtype must be one of {EXPORT_DTYPES}, got {self.export_dtype!r}")
    if not self.model.policy_path:
      raise ValueError("model.policy_path is required (a local HF directory), got ''")
    if not self.data.train_path:
      raise ValueError("data.train_path is required (a prompt file), got ''")
    if self.engine.kind not in MODEL_ENGINES:
      raise ValueError(f"engine.kind={self.engine.kind!r} cannot serve the Stage 3 policy (its "
                       f"weights change every step): use one of {MODEL_ENGINES}")
    obj, replay, needs = self.train.objective, self.train.replay, self.train.needs
    if needs.anchor and not self.data.anchor_path:
      raise ValueError(f"data.anchor_path is required for objective {obj.name!r}, got ''")
    if not needs.anchor and self.data.anchor_path:
      raise ValueError(f"data.anchor_path={self.data.anchor_path!r} is set but objective "
                       f"{obj.name!r} uses no anchor")
    if replay.enabled != bool(self.data.replay_path):
      raise ValueError(f"data.replay_path={self.data.replay_path!r} and train.replay.fraction="
                       f"{replay.fraction} must be set together (replay needs the Stage 1 file)")

  @classmethod
  def from_config(cls, config: Any) -> "Stage3Config":
    """From a ConfigDict / dict (unknown fields and bad values raise, naming the field)."""
    return config_lib.from_mapping(cls, config)


def load_prompt_items(path: str, fmt: str, tokenizer: Any, rendering: str, max_len: int):
  """The prompts of ``path`` as `PromptItem`s (ids by `encode_prompt`, reward meta attached)."""
  return [PromptItem(r.prompt_id, encode_prompt(tokenizer, r, rendering, max_len=max_len),
                     r.reward_meta()) for r in load_prompts(path, fmt)]


def anchor_identity(cfg: Stage3Config) -> dict[str, str]:
  """The reference model and prompt rendering the run's anchor must have been fitted under."""
  return {"reference": cfg.model.reference, "rendering": cfg.data.rendering}


def anchor_source(cfg: Stage3Config) -> str:
  """Where the run's anchor comes from (the prefix of an anchor mismatch)."""
  return f"data.anchor_path={cfg.data.anchor_path!r}"


def load_anchor(cfg: Stage3Config, hidden_size: int):
  """The frozen anchor, refused if it was fitted on another reference, rendering or label facts
  (`disa_jax.rl.build.validate_anchor`; preflight's check before a launch)."""
  anchor = anchor_lib.load_anchor(cfg.data.anchor_path)
  validate_anchor(cfg.train, anchor, hidden_size=hidden_size,
                  identity=anchor_identity(cfg), source=anchor_source(cfg))
  return anchor


def model_options(mc: BackboneConfig, rc: RolloutConfig, *, trained: bool) -> models.ModelOptions:
  """The `ModelOptions` of a Stage 3 model: the one place the trainer, the benchmarks and the
  compile tool (`benchmarks/plan_memory.py`) take them from.

  Args:
    mc: the run's ``model`` section (attention, remat).
    rc: its ``rollout`` section (`RolloutConfig`): the packing's sequences per row bound the
      segments of a row (``max_segments``; 1 without packing) and its longest sequence the band.
    trained: the policy (remat as configured) or the frozen reference (no backward pass, no
      remat).
  """
  remat = dict(remat=mc.remat, remat_policy=mc.remat_policy, scan_unroll=mc.scan_unroll)
  return models.ModelOptions(
      attention_chunk=mc.attention_chunk, attention_impl=mc.attention_impl,
      max_segments=rc.seqs_per_row if rc.packing else 1, max_segment_len=rc.max_segment_len,
      **(remat if trained else {}))


def _load_models(cfg: Stage3Config, mesh):
  mc, rc = cfg.model, cfg.train.rollout
  # from_pretrained ties storage and compute dtype: the policy is loaded in param_dtype (the AdamW
  # master copy) and then computes in dtype; the frozen reference is stored in dtype.
  policy = models.from_pretrained(mc.policy_path, dtype=jnp.dtype(mc.param_dtype), mesh=mesh,
                                  **dataclasses.asdict(model_options(mc, rc, trained=True)))
  policy.dtype = jnp.dtype(mc.dtype)
  reference = None
  if cfg.train.needs.reference_model:
    reference = models.from_pretrained(
        mc.reference, dtype=jnp.dtype(mc.dtype), mesh=mesh,
        **dataclasses.asdict(model_options(mc, rc, trained=False)))
  return policy, reference


def exact_measures(cfg: Stage3Config, tokenizer: Any, policy, engine):
  """``(step) -> metrics``: the exact measures of the current policy (the task's measurement hook,
  `disa_jax.tasks.base.Task.measures`), prefixed 'exact/', on the validation prompts (or the
  training prompts); with ``exact_target.heldout_path`` also those of the prompts in that file,
  prefixed 'exact_heldout/' (one policy scorer and one reference for both).

  Args:
    cfg: the run's config (``exact_target``, ``data``, ``train.rollout``).
    tokenizer: the policy's tokenizer.
    policy: the policy model (its scorer is refreshed before each measurement).
    engine: the engine serving the policy.

  Returns:
    ``(step) -> {"exact/<measure>": float, ...}`` (`ExactMeasures.to_json` without
    ``per_prompt``).

  Raises:
    ValueError: in a multi-process run, for prompts of several abilities, or for a task without
      an exact target.
  """
  if jax.process_count() > 1:
    raise ValueError("exact_target runs in single-process runs only")
  et = cfg.exact_target
  pad = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id)
  reference = functools.lru_cache(maxsize=1)(
      lambda: et.scorer(et.load_model(et.reference_path), pad))
  sets = {"exact": cfg.data.validation_paths or (cfg.data.train_path,)}
  if et.heldout_path:
    sets["exact_heldout"] = (et.heldout_path,)
  trackers = {prefix: _tracker(cfg, tokenizer, paths, reference) for prefix, paths in sets.items()}
  policy_scorer = et.scorer(policy, pad)

  def measures(step: int):
    policy_scorer.update(policy)
    out = {}
    for prefix, tracker in trackers.items():
      got = tracker.measure(engine, policy_scorer, step=step).to_json(per_prompt=False)
      out.update({f"{prefix}/{k}": float(v) for k, v in got.items()})
    return out

  return measures


def _tracker(cfg: Stage3Config, tokenizer: Any, paths: Sequence[str],
             reference: Callable[[], Any]) -> Any:
  """The task's exact tracker of the prompts in ``paths`` (`exact_measures`)."""
  dc = cfg.data
  records = [r for p in paths for r in load_prompts(p, dc.prompts_format)]
  abilities = {r.ability for r in records}
  if len(abilities) != 1:
    raise ValueError(f"exact_target needs prompts of one ability, got {sorted(abilities)} in "
                     f"{list(paths)}")
  ability = abilities.pop()
  tracker = tasks.get_task(ability).measures(
      cfg.exact_target, tokenizer,
      [encode_prompt(tokenizer, r, dc.rendering, max_len=cfg.train.rollout.max_prompt_len)
       for r in records], [r.reward_meta() for r in records], reference,
      max_tokens=cfg.train.rollout.max_response_len)
  if tracker is None:
    raise ValueError(f"exact_target.reference_path is set but the prompts' task {ability!r} has "
                     "no exact target (its correct set cannot be enumerated)")
  return tracker


def _identity(cfg: Stage3Config) -> dict[str, Any]:
  """What a resumed checkpoint must have been written with, beside the train config. The input
  files are not named: ``identity.json`` compares them by content before (a checkpoint written
  when this recorded their paths too still resumes: the trainer compares this run's fields)."""
  return {"data.reward": cfg.data.reward, "data.rendering": cfg.data.rendering}


# What overwrite=True deletes.
RUN_OUTPUTS = ("checkpoints", "in_flight", "metrics.jsonl", "tb", "final", "stage3_summary.json")


def claim_stage3_output(cfg: Stage3Config) -> str:
  """Records (or checks) ``<workdir>/identity.json``; `identity.claim_output`'s state."""
  workdir, mc, dc = Path(cfg.workdir), cfg.model, cfg.data
  ident = {**identity.inputs(policy_path=mc.policy_path, reference_path=mc.reference,
                             train_path=dc.train_path, anchor_path=dc.anchor_path,
                             replay_path=dc.replay_path,
                             **{f"validation_paths.{i}": p for i, p in enumerate(dc.validation_paths)},
                             # the exact measures' pi_ref and held-out prompts, by content
                             exact_reference_path=cfg.exact_target.reference_path,
                             exact_heldout_path=cfg.exact_target.heldout_path),
           "model": config_lib.to_dict(mc), "data": config_lib.to_dict(dc),
           "exact_target": config_lib.to_dict(cfg.exact_target),
           **train_identity(config_lib.to_dict(cfg.train))}

  def recorded(missing: list[str]) -> dict[str, Any]:
    # training settings from the latest checkpoint; the exact measures' inputs, fingerprinted since,
    # where an older identity file names them at the same place (its exact_target section)
    return {**recorded_train_identity(workdir, cfg.train.objective),
            **identity.added_inputs(ident, missing, "exact_")}

  return identity.claim_output(workdir / "identity.json", ident, overwrite=cfg.overwrite,
                               has_output=(workdir / "checkpoints").exists(),
                               discard=lambda: identity.remove_paths(workdir / n
                                                                     for n in RUN_OUTPUTS),
                               recorded=recorded)


SERIES_FIELDS = ("p_correct", "entropy_correct", "target_entropy_correct", "kl_mc", "kl_mc_se",
                 "kl_binary", "kl_correct", "p_correct_kl_correct", "p_wrong_kl_wrong",
                 "kl_decomposed", "kl_decomposed_se")


@dataclasses.dataclass(frozen=True, eq=False)
class ExactSeries:
  """The exact measures a Stage 3 run logged (``exact/*`` in metrics.jsonl, `exact_target`), one
  entry per measurement: ``step`` ``[M]`` (int64) and every field of `SERIES_FIELDS` ``[M]``
  (float64). ``series[name]`` reads a field (the `pipeline.dynamics` functions take a mapping)."""
  step: np.ndarray
  p_correct: np.ndarray
  entropy_correct: np.ndarray
  target_entropy_correct: np.ndarray
  kl_mc: np.ndarray
  kl_mc_se: np.ndarray
  kl_binary: np.ndarray
  kl_correct: np.ndarray
  p_correct_kl_correct: np.ndarray
  p_wrong_kl_wrong: np.ndarray
  kl_decomposed: np.ndarray
  kl_decomposed_se: np.ndarray

  __eq__ = artifacts.fields_equal

  def __getitem__(self, name: str) -> np.ndarray:
    if name != "step" and name not in SERIES_FIELDS:
      raise KeyError(name)
    return getattr(self, name)

  @classmethod
  def from_rows(cls, rows: list[Mapping[str, Any]], path: str | Path = "metrics",
                prefix: str = "exact") -> "ExactSeries":
    """From metrics rows (read from ``path``); only the rows with exact measures under ``prefix``
    count ('exact', or 'exact_heldout' for the held-out prompts), and one of them missing a field
    raises `ArtifactError` naming ``path``, the step and the field."""
    rows = [r for r in rows if f"{prefix}/kl_mc" in r]
    for r in rows:
      for f in SERIES_FIELDS:
        if f"{prefix}/{f}" not in r:
          raise artifacts.ArtifactError(f"{path}: step {r.get('step')} lacks field "
                                        f"'{prefix}/{f}'")
    return cls(step=np.asarray([r["step"] for r in rows], np.int64),
               **{f: np.asarray([r[f"{prefix}/{f}"] for r in rows], np.float64)
                  for f in SERIES_FIELDS})


@dataclasses.dataclass(frozen=True)
class Stage3Run:
  """A Stage 3 run: what `run_stage3` returns, persisted as ``<workdir>/stage3_summary.json``.

  Attributes:
    workdir: the run directory (owns checkpoints/, metrics.jsonl, final/).
    steps_run: RL steps run by the call that wrote the summary.
    start_step: the step it resumed from (0 for a fresh run).
    final: the last step's metrics of that call (None when it ran no step).
    export: the exported policy (``<workdir>/final``), None when not exported (or preempted).
    export_checkpoint: the checkpoint the export holds, and why (`checkpoint.selection.Choice`).
    preempted: the step a SIGTERM / SIGUSR1 stopped the run at, else None.
    selection: the validation scores the export's choice reads (`checkpoint.selection`).
    stop_token_ids: the rollouts' stop ids.
  """
  workdir: Path
  steps_run: int
  start_step: int
  final: Mapping[str, float] | None
  export: Path | None
  preempted: int | None
  selection: selection.Selection
  export_checkpoint: selection.Choice | None
  stop_token_ids: tuple[int, ...]

  FILE = "stage3_summary.json"

  @property
  def metrics_path(self) -> Path:
    return self.workdir / "metrics.jsonl"

  def checkpoint_steps(self) -> list[int]:
    """The finished checkpoint steps under ``<workdir>/checkpoints``, ascending."""
    return selection.finished_steps(self.workdir)

  def metrics(self) -> list[dict[str, float]]:
    """Every step's metrics row (metrics.jsonl), in order."""
    return artifacts.read_jsonl(self.metrics_path, "the Stage 3 metrics")

  def exact_series(self, prefix: str = "exact") -> ExactSeries:
    """The run's exact measures under ``prefix`` ('exact', or 'exact_heldout': the held-out
    prompts'), empty when it logged none."""
    return ExactSeries.from_rows(self.metrics(), self.metrics_path, prefix)

  def to_json(self) -> dict[str, Any]:
    return codec.encode(self)

  def save(self) -> None:
    """``stage3_summary.json`` in the run directory (main process only)."""
    if distributed.is_main_process():
      (self.workdir / self.FILE).write_text(json.dumps(self.to_json(), indent=1, default=str))

  @classmethod
  def load(cls, workdir: str | Path) -> "Stage3Run":
    """The run whose summary ``<workdir>/stage3_summary.json`` holds."""
    return codec.load(cls, Path(workdir) / cls.FILE, "the Stage 3 run", workdir=Path(workdir))


def run_stage3(cfg: Stage3Config) -> Stage3Run:
  """Trains (or resumes) the run; returns it (`Stage3Run`: final metrics, export path and
  checkpoint, ``preempted``: the step a SIGTERM / SIGUSR1 stopped it at, else None).

  Raises:
    OutputLockedError: another run holds ``workdir``.
    IdentityMismatchError: ``workdir`` holds a run of other inputs and ``overwrite`` is off.
  """
  if not cfg.workdir:
    raise ValueError("workdir is required (the run directory), got ''")
  with naming(cfg.workdir, "the Stage 3 run directory"):
    Path(cfg.workdir).mkdir(parents=True, exist_ok=True)
  with preemption.watch():  # from here on a SIGTERM / SIGUSR1 stops the run cleanly
    with owned_output(Path(cfg.workdir) / ".lock", f"the Stage 3 run {cfg.workdir}",
                      lambda: claim_stage3_output(cfg), owner=distributed.is_main_process()):
      return _run_stage3(cfg)


def _preempted_before_training(cfg: Stage3Config) -> Stage3Run | None:
  """The saved summary of a run a preemption signal stopped during start-up (nothing new to
  save), else None (collective in a multi-process run)."""
  if not preemption.agreed(distributed.any_process):
    return None
  at = ([0] + selection.finished_steps(cfg.workdir))[-1]
  print(f"stage3: preempted ({preemption.requested() or 'signal on another process'}) during "
        "start-up; nothing new to save, rerun the command to resume", flush=True)
  run = Stage3Run(workdir=Path(cfg.workdir), steps_run=0, start_step=at, final=None, export=None,
                  export_checkpoint=None, preempted=at, stop_token_ids=(),
                  selection=selection.Selection(metric=f"eval/mean@{cfg.train.validation.n}"))
  run.save()
  return run


def _run_stage3(cfg: Stage3Config) -> Stage3Run:
  """`run_stage3` once the run directory is locked and its identity checked."""

  workdir = Path(cfg.workdir)
  if distributed.is_main_process():
    with naming(workdir / "config.json", "the Stage 3 config"):
      (workdir / "config.json").write_text(json.dumps(config_lib.to_dict(cfg), indent=1))
  import_reward_plugins(cfg.data.reward_plugins)
  tc, dc = cfg.train, cfg.data
  if tc.replay.enabled:  # the replayed rewards were graded against Stage 1's prompt file
    check_stage1_prompts(dc.replay_path, field="data.train_path", prompts_path=dc.train_path,
                         prompts_format=dc.prompts_format)
  tokenizer = load_tokenizer(cfg.model.policy_path)
  items = lambda p: load_prompt_items(p, dc.prompts_format, tokenizer, dc.rendering,
                                      tc.rollout.max_prompt_len)
  prompts = items(dc.train_path)
  validation = [it for p in dc.validation_paths for it in items(p)]
  reward_fn = rewards.get_reward_fn(dc.reward)
  mesh = cfg.mesh.make()
  policy, reference = _load_models(cfg, mesh)
  # Checked once, by build_trainer (`validate_anchor`).
  anchor = anchor_lib.load_anchor(dc.anchor_path) if tc.needs.anchor else None
  pool = (ReplayPool.from_stage1(dc.replay_path, max_response_len=tc.rollout.max_response_len,
                                 correct_only=tc.replay.correct_only, dedupe=tc.replay.dedupe,
                                 first_samples=tc.replay.first_samples)
          if tc.replay.enabled else None)
  stop = stop_ids.stop_token_ids(tokenizer, cfg.model.policy_path,
                                 chat_template=dc.rendering == "chat_template")
  early = _preempted_before_training(cfg)
  if early is not None:
    return early
  # One generation process per host, owned by the host's first process (all of them in a
  # single-process run); DISA_GENERATION_GPUS gives it the GPUs the trainer leaves free.
  engine = (cfg.engine.make(cfg.model.policy_path, env=generation_env())
            if distributed.is_host_leader() else None)
  try:
    task = RolloutTask(
        prompts, reward_fn, lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
        tuple(stop), int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None
                         else tokenizer.eos_token_id), validation_prompts=validation,
        replay_pool=pool)
    trainer = build_trainer(
        tc, str(workdir), StepModels(policy, reference, mesh), task,
        EngineLink(engine, jnp.dtype(cfg.engine.dtype), cfg.engine.push_bucket_bytes),
        AnchorInput(anchor, anchor_identity(cfg), anchor_source(cfg)), identity=_identity(cfg),
        measures=(exact_measures(cfg, tokenizer, policy, engine)
                  if cfg.exact_target.enabled else None))
    history = trainer.run()
    trainer.close()
  finally:
    if engine is not None:
      engine.close()
  run = Stage3Run(workdir=workdir, steps_run=len(history), start_step=trainer.start_step,
                  final=history[-1] if history else None, export=None, export_checkpoint=None,
                  preempted=trainer.preempted_at, selection=trainer.selection,
                  stop_token_ids=tuple(int(t) for t in stop))
  if trainer.preempted_at is not None:
    saved = (f"checkpoint {trainer.preempted_at} saved" if trainer.preempted_at > trainer.start_step
             else "no new step to save")
    print(f"stage3: preempted ({preemption.requested() or 'signal on another process'}); {saved}, "
          "rerun the command to resume", flush=True)
    run.save()
    return run
  final = workdir / "final"
  if cfg.export and distributed.is_main_process():
    if not (final / "export_info.json").exists():
      choice = selection.choose_step(workdir, cfg.export_checkpoint)
      print(f"stage3: exporting checkpoint {choice.step}: {choice.reason}", flush=True)
      export.export_policy(workdir, final, step=choice.step, dtype=cfg.export_dtype,
                           overwrite_partial=True, choice=choice)
    choice = json.loads((final / "export_info.json").read_text()).get("checkpoint")
    run = dataclasses.replace(run, export=final, export_checkpoint=None if choice is None else
                              codec.decode(selection.Choice, choice, final / "export_info.json",
                                           "checkpoint"))
  run.save()
  return run
