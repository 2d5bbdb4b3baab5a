"""The Stage 1 command on real checkpoints: proposal samples -> rewards -> log pi_ref -> IS labels.

`run_stage1(Stage1Config)` loads a prompt dataset (veRL parquet/jsonl or a benchmark file), renders
each prompt for the reference (its chat template: how the Stage 3 policy sees it) and for the
proposal (its own template), samples N responses per prompt from the proposal through a rollout
engine (vLLM by default; the JAX sampler works too), grades them with a registered reward, records
the proposal's log-probs of the tokens it sampled ('processed': of the distribution actually sampled
from; 'raw': the unmodified model), scores log pi_ref with the JAX `SequenceScorer` (packed rows) on a device
mesh, and appends labelled records (eq. 8) to the resumable Stage 1 dataset through
`collect_stage1`.

Output directory:
    stage1.jsonl | stage1/part-*.parquet   the Stage 1 dataset (`disa_jax.estimators.load_stage1`)
    stage1_identity.json                   what the labels depend on (`disa_jax.checkpoint.identity`:
                                           the prompt file and both checkpoints with content hashes,
                                           sampling, beta, transform, ...); a rerun must agree or
                                           set ``overwrite``
    stage1_config.json                     the resolved config (Stage 2 and SFT read the prompt
                                           file and rendering from it)
    stage1_summary.json                    `stage1_summary`: ESS / CV^2 quantiles, share of prompts
                                           without a reward-bearing sample, throughput

A rerun with the same output directory skips the prompts already written (and starts no engine when
none is left). The dataset has one writer at a time (a second run gets `OutputLockedError`).
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

import jax.numpy as jnp
import numpy as np

from disa_jax import artifacts, codec
from disa_jax import config as config_lib
from disa_jax import models, paths, preemption, rewards
from disa_jax.checkpoint import identity
from disa_jax.checkpoint.files import naming
from disa_jax.data.prompting import check_rendering, encode_prompt, render_prompt
from disa_jax.data.tokenizer import load_tokenizer
from disa_jax.estimators import Stage1Writer, collect, load_stage1
from disa_jax.estimators.dataset import LABEL_SCALES, PROPOSAL_LOGPROBS, Stage1Data
from disa_jax.estimators.reward_transforms import RewardTransform
from disa_jax.parallel.mesh import MeshConfig
from disa_jax.rollout import stop_ids
from disa_jax.rollout.engines import EngineConfig
from disa_jax.rollout.types import SamplingParams
from disa_jax.scoring.batched import SEQS_PER_ROW, SequenceScorer
# (Importing `disa_jax.tasks` registers the built-in tasks and their rewards: math, code, sum_task.)
from disa_jax.tasks.prompts import load_prompts
from disa_jax.tasks.registry import import_reward_plugins
from disa_jax.workflows import prompting

QUANTILES = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0)
# Config fields that determine the labels (beside the input files' paths and contents): a rerun
# into the same directory must not change them.
IDENTITY_FIELDS = ("prompts_format", "dataset_format", "rendering", "max_prompt_len", "reward",
                   "beta", "reward_transform", "label_scale", "proposal_logprobs", "sampling")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScorerConfig:
  """How the reference model scores log pi_ref (Stage 1) and embeds prompts (Stage 2) in JAX.

  Attributes:
    dtype: parameter / compute dtype of the reference model ('bfloat16', 'float32').
    batch_size: rows per forward pass (one sequence per row without packing).
    packing: pack several sequences into each row (`disa_jax.data.packing`; one compiled shape);
      False: one sequence per row, padded to the pass's longest rounded up to ``pad_to``.
    row_len: tokens per packed row; 0 = the smallest power of two (>= 64) holding the longest
      sequence seen so far (`disa_jax.scoring.batched.grown_row_len`).
    pad_to: without packing, the sequence-length bucket (tokens).
    chunk_size: vocabulary-chunk rows of the log-prob kernel.
    attention_chunk: attention query block of the reference model ('xla' / 'dense' attention;
      0 = no chunking: the implementation's own query blocks; c > 0 = blocks of c queries whose
      probabilities the backward pass recomputes; `disa_jax.models.Transformer`).
    attention_impl: the reference model's attention over packed rows
      (`disa_jax.config.ATTENTION_IMPLS`; 'auto' picks by backend).
    mesh: the reference model's device mesh.
  """

  dtype: str = "bfloat16"
  batch_size: int = 16
  packing: bool = True
  row_len: int = 0
  pad_to: int = 256
  chunk_size: int = 1024
  attention_chunk: int = 0
  attention_impl: str = "auto"
  mesh: MeshConfig = MeshConfig()

  def __post_init__(self):
    config_lib.check_attention_chunk(self.attention_chunk, "scorer.attention_chunk")
    config_lib.check_attention_impl(self.attention_impl, "scorer.attention_impl")
    for name in ("batch_size", "pad_to", "chunk_size"):
      if getattr(self, name) < 1:
        raise ValueError(f"scorer.{name} must be >= 1, got {getattr(self, name)}")
    if self.row_len < 0:
      raise ValueError(f"scorer.row_len must be >= 0 (0 = grow with the data), got {self.row_len}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Stage1Config(config_lib.Section):
  """Typed view of `configs/stage1_paper.py` (the fields are documented there)."""

  prompts_path: str
  reference_path: str
  proposal_path: str
  output_dir: str
  prompts_format: str = "auto"
  limit: int = 0
  dataset_format: str = "parquet"
  rendering: str = "chat_template"
  max_prompt_len: int = 2048
  reward: str = "math"
  reward_plugins: tuple[str, ...] = ()
  beta: float = 15.0
  reward_transform: RewardTransform = RewardTransform(kind="group_zscore")
  label_scale: str = "mean"
  proposal_logprobs: str = "processed"
  sampling: SamplingParams = SamplingParams(n=8, temperature=0.6, top_p=0.95, max_tokens=32768)
  engine: EngineConfig = EngineConfig()
  scorer: ScorerConfig = ScorerConfig()
  prompts_per_batch: int = 64
  progress: bool = True
  overwrite: bool = False

  def __post_init__(self):
    for name in ("prompts_path", "reference_path", "proposal_path", "output_dir"):
      if not getattr(self, name):
        raise ValueError(f"{name} is required (a local path), got ''")
    if self.dataset_format not in ("jsonl", "parquet"):
      raise ValueError(f"dataset_format must be 'jsonl' or 'parquet', got {self.dataset_format!r}")
    check_rendering(self.rendering)
    if self.label_scale not in LABEL_SCALES:
      raise ValueError(f"label_scale must be one of {LABEL_SCALES}, got {self.label_scale!r}")
    if self.proposal_logprobs not in PROPOSAL_LOGPROBS:
      raise ValueError(f"proposal_logprobs must be one of {PROPOSAL_LOGPROBS}, got "
                       f"{self.proposal_logprobs!r}")
    if not self.beta > 0:
      raise ValueError(f"beta must be > 0, got {self.beta}")
    if not self.sampling.temperature > 0:
      raise ValueError(f"sampling.temperature must be > 0 (IS needs a sampling density), got "
                       f"{self.sampling.temperature}")
    if self.limit < 0 or self.prompts_per_batch < 1 or self.max_prompt_len < 1:
      raise ValueError(f"limit must be >= 0, prompts_per_batch and max_prompt_len >= 1; got "
                       f"{self.limit}, {self.prompts_per_batch}, {self.max_prompt_len}")


  def dataset_path(self) -> paths.AnyPath:
    """Where the Stage 1 dataset lives (a .jsonl file or a parquet part directory)."""
    name = "stage1.jsonl" if self.dataset_format == "jsonl" else "stage1"
    return paths.as_path(self.output_dir) / name


# ------------------------------------------------------------------------------------------------
# Shared helpers (also used by Stage 2 and evaluation).
# ------------------------------------------------------------------------------------------------


def load_reference(path: str, scorer: ScorerConfig):
  """The reference model from a local HF directory on the scorer's mesh.

  Its rows hold at most `disa_jax.scoring.batched.SEQS_PER_ROW` sequences (the scorer's and the
  prompt embeddings' packing; one without packing): its ``max_segments``. No segment bound
  (``max_segment_len``, the 'xla' band) is set: the scored sequences have none below the row
  (dataset samples of any length, responses re-tokenised by the reference's tokenizer, ``row_len``
  grown to the longest), and a row breaking it would come out NaN.
  """
  return models.from_pretrained(path, dtype=jnp.dtype(scorer.dtype), mesh=scorer.mesh.make(),
                                attention_chunk=scorer.attention_chunk,
                                attention_impl=scorer.attention_impl,
                                max_segments=SEQS_PER_ROW if scorer.packing else 1)


def claim_stage1_output(cfg: Stage1Config) -> str:
  """Records (or checks) the identity of ``cfg``'s inputs in ``stage1_identity.json`` and writes
  ``stage1_config.json``; returns `disa_jax.checkpoint.identity.claim_output`'s state.

  Raises:
    IdentityMismatchError: the directory holds labels of other inputs and ``cfg.overwrite`` is off.
  """
  out_dir = paths.as_path(cfg.output_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  config = config_lib.to_dict(cfg)
  ident = {**identity.inputs(prompts_path=cfg.prompts_path, reference_path=cfg.reference_path,
                             proposal_path=cfg.proposal_path),
           **{f: config[f] for f in IDENTITY_FIELDS}}

  state = identity.claim_output(
      out_dir / "stage1_identity.json", ident, overwrite=cfg.overwrite,
      has_output=cfg.dataset_path().exists(),
      discard=lambda: identity.remove_paths([cfg.dataset_path(), out_dir / "stage1_summary.json"]))
  tmp = out_dir / "stage1_config.json.tmp"
  with naming(tmp, "the Stage 1 config"):
    tmp.write_text(json.dumps(config, indent=1))
    paths.replace(tmp, out_dir / "stage1_config.json")
  return state


def encode_stage1_prompts(stage1_path: str, reference_path: str,
                          data: Any) -> tuple[list[tuple[int, ...]], str]:
  """The token ids of a Stage 1 dataset's prompts as the reference saw them, and their rendering.

  Stage 2 (embeddings) and the SFT baseline re-encode Stage 1's prompts with `encode_prompt`: the
  prompt file and rendering come from Stage 1's ``stage1_config.json`` beside the dataset.
  A reference other than Stage 1's (by path, or by content: the fingerprint Stage 1's identity
  records), or a prompt whose rendered text differs from the one Stage 1 stored (the prompt file or
  tokenizer changed), is refused.

  Args:
    stage1_path: the Stage 1 dataset (inside Stage 1's output directory).
    reference_path: pi_ref's HF directory.
    data: the loaded `Stage1Data`.

  Returns:
    (``[P]`` token ids in the dataset's prompt order, the rendering).
  """
  s1_file = paths.as_path(stage1_path).parent / "stage1_config.json"
  if not s1_file.exists():
    raise FileNotFoundError(f"stage1_path={stage1_path!r}: {s1_file} not found; Stage 2 and the SFT baseline need "
                            "the Stage 1 run's config (prompt file, rendering) beside its dataset")
  s1 = json.loads(s1_file.read_text())
  if not _same_reference(s1["reference_path"], reference_path, s1_file.parent):
    raise ValueError(f"reference_path={reference_path!r} differs from the reference Stage 1 "
                     f"scored the labels under ({s1['reference_path']!r}, in {s1_file}), by path "
                     "and by content")
  tok = load_tokenizer(reference_path)
  by_id = {r.prompt_id: r for r in load_prompts(s1["prompts_path"], s1["prompts_format"])}
  ids = []
  for pid, stored in zip(data.prompt_ids, data.prompts):
    if pid not in by_id:
      raise ValueError(f"Stage 1 prompt {pid!r} is not in its prompt file {s1['prompts_path']!r}")
    if render_prompt(tok, by_id[pid], s1["rendering"]) != stored:
      raise ValueError(f"prompt {pid!r}: the text rendered now differs from what Stage 1 stored; "
                       f"the prompt file {s1['prompts_path']!r} or the tokenizer changed")
    ids.append(encode_prompt(tok, by_id[pid], s1["rendering"], max_len=s1["max_prompt_len"]))
  return ids, s1["rendering"]


def _same_reference(recorded: str, reference_path: str, out_dir: paths.AnyPath) -> bool:
  """Whether ``reference_path`` is the reference Stage 1 (output in ``out_dir``) scored under:
  the ``recorded`` path, or the content its ``stage1_identity.json`` fingerprints."""
  if os.path.realpath(recorded) == os.path.realpath(reference_path):
    return True
  ident = out_dir / "stage1_identity.json"
  stored = json.loads(ident.read_text()).get("reference_path.sha256") if ident.exists() else None
  return stored is not None and identity.fingerprint(reference_path) == stored


def _quantiles(x: np.ndarray) -> dict[str, float | None]:
  x = np.asarray(x, np.float64)
  x = x[np.isfinite(x)]
  return {f"q{int(q * 100):02d}": (float(np.quantile(x, q)) if x.size else None) for q in QUANTILES}


def stage1_summary(data: Any, run: dict[str, float] | None = None) -> dict[str, Any]:
  """Diagnostics of a Stage 1 dataset.

  Args:
    data: a `disa_jax.estimators.Stage1Data` (P prompts, up to N samples each).
    run: the throughput figures of the run that just finished (`collect_stage1`'s return, plus
      ``generated_tokens``), or None.

  Returns:
    dict with ``prompts``, ``samples``, ``ess`` / ``ess_fraction`` (ESS / n_valid) / ``cv2`` /
    ``max_weight_share`` / ``log_z_is`` quantiles (q00 ... q100, over finite values),
    ``nonfinite_labels`` (count and first ids), ``share_no_reward`` (prompts whose samples all have
    raw reward <= 0), ``mean_reward``, ``mean_response_tokens``, ``grade_errors`` (samples whose
    grader raised or timed out; they count as reward 0) and ``run``.
  """
  mask = data.mask  # [P, N]
  reward = np.where(mask, data.reward, 0.0)  # [P, N]
  bearing = np.any(mask & (data.reward > 0), axis=1)  # [P]
  labels = np.asarray(data.stats.log_z_is)  # [P]
  n_valid = np.asarray(data.stats.n_valid, np.float64)  # [P]
  bad = np.flatnonzero(~np.isfinite(labels))
  out = {
      "prompts": int(mask.shape[0]),
      "samples": int(mask.sum()),
      "beta": data.beta, "label_scale": data.label_scale,
      "reward_transform": codec.encode(data.reward_transform),
      "proposal_logprobs": data.proposal_logprobs,
      "ess": _quantiles(data.stats.ess),
      "ess_fraction": _quantiles(data.stats.ess / np.maximum(n_valid, 1)),
      "cv2": _quantiles(data.stats.cv2),
      "max_weight_share": _quantiles(data.stats.max_weight_share),
      "log_z_is": _quantiles(labels),
      "nonfinite_labels": {"count": int(bad.size),
                           "prompt_ids": [data.prompt_ids[i] for i in bad[:20]]},
      "share_no_reward": float(1.0 - bearing.mean()),
      "mean_reward": float(reward.sum() / max(mask.sum(), 1)),
      "mean_response_tokens": float(np.where(mask, data.num_tokens, 0).sum() / max(mask.sum(), 1)),
      "grade_errors": int(0 if data.grade_error is None else (data.grade_error & mask).sum()),
  }
  out["run"] = dict(run) if run else None
  return out


QUANTILE_FIELDS = ("ess", "ess_fraction", "cv2", "max_weight_share", "log_z_is")


@dataclasses.dataclass(frozen=True)
class Stage1Diagnostics:
  """`stage1_summary` of a finished Stage 1 dataset (P prompts, up to N samples each).

  Attributes:
    prompts, samples: P and the valid samples.
    beta, label_scale, reward_transform, proposal_logprobs: the label facts of the dataset.
    ess, ess_fraction, cv2, max_weight_share, log_z_is: quantiles over prompts (``q00`` ... ``q100``
      over finite values) of the ESS, ESS / n_valid, CV^2, largest weight share and label.
    nonfinite_labels: prompts whose label is not finite; nonfinite_prompt_ids: the first 20.
    share_no_reward: prompts whose samples all have reward <= 0.
    mean_reward, mean_response_tokens: over valid samples.
    grade_errors: samples whose grader raised or timed out (reward 0).
  """
  prompts: int
  samples: int
  beta: float
  label_scale: str
  reward_transform: RewardTransform
  proposal_logprobs: str
  ess: Mapping[str, float]
  ess_fraction: Mapping[str, float]
  cv2: Mapping[str, float]
  max_weight_share: Mapping[str, float]
  log_z_is: Mapping[str, float]
  nonfinite_labels: int = codec.field(key="nonfinite_labels.count")
  nonfinite_prompt_ids: tuple[str, ...] = codec.field(key="nonfinite_labels.prompt_ids")
  share_no_reward: float
  mean_reward: float
  mean_response_tokens: float
  grade_errors: int


@dataclasses.dataclass(frozen=True)
class Stage1Result:
  """Stage 1's output: what `run_stage1` returns; a finished one is persisted as
  ``<output_dir>/stage1_summary.json`` beside its dataset.

  Attributes:
    output_dir: the Stage 1 directory.
    dataset: the dataset (`data()` loads it: ``[P, N]`` arrays, typed samples and labels).
    preempted: a SIGTERM / SIGUSR1 stopped the call between batches (no summary; a rerun resumes).
    run: the call's throughput figures (`collect.collect_stage1`'s, with ``generated_tokens`` and
      ``tokens_per_s`` once finished).
    stop_token_ids: the proposal's stop ids (() when preempted).
    diagnostics: the dataset's statistics (None when preempted).
  """
  output_dir: Path = codec.field(stored=False)
  preempted: bool = codec.field(omit=False)
  diagnostics: Stage1Diagnostics | None = codec.field(inline=True, omit=None)
  run: Mapping[str, float] | None
  dataset: Path
  stop_token_ids: tuple[int, ...]

  FILE = "stage1_summary.json"

  def data(self) -> Stage1Data:
    return load_stage1(self.dataset)

  def to_json(self) -> dict[str, Any]:
    """stage1_summary.json (``{"preempted": True, "run", "dataset"}`` for a preempted call)."""
    return codec.encode(self, omit=("stop_token_ids",) if self.preempted else ())

  def save(self) -> None:
    artifacts.write_json(self.output_dir / self.FILE, self.to_json())

  @classmethod
  def load(cls, output_dir: str | Path) -> "Stage1Result":
    """The finished Stage 1 output in ``output_dir`` (its dataset there: the stored path names
    where the output was written, which a copied output is not)."""
    out = paths.as_path(output_dir)
    res = codec.load(cls, out / cls.FILE, "the Stage 1 output", output_dir=out)
    return dataclasses.replace(res, dataset=out / res.dataset.name)


# ------------------------------------------------------------------------------------------------
# The command.
# ------------------------------------------------------------------------------------------------


def _encode_all(cfg: Stage1Config, records, ref_tok, prop_tok):
  """(reference texts, reference ids, proposal ids) of every record, by `encode_prompt`."""
  ref_texts = [render_prompt(ref_tok, r, cfg.rendering) for r in records]
  ref_ids = [encode_prompt(ref_tok, r, cfg.rendering, max_len=cfg.max_prompt_len) for r in records]
  prop_ids = [encode_prompt(prop_tok, r, cfg.rendering, max_len=cfg.max_prompt_len)
              for r in records]
  return ref_texts, ref_ids, prop_ids


def run_stage1(cfg: Stage1Config) -> Stage1Result:
  """Runs (or resumes) Stage 1; returns its output (`Stage1Result`, also written to
  ``stage1_summary.json``), or, when a SIGTERM / SIGUSR1 stopped it between batches
  (`disa_jax.preemption`), one with ``preempted`` set (no summary file: a rerun resumes)."""
  with preemption.watch():
    return _run_stage1(cfg)


def _run_stage1(cfg: Stage1Config) -> Stage1Result:
  out_dir = paths.as_path(cfg.output_dir)
  claim_stage1_output(cfg)
  import_reward_plugins(cfg.reward_plugins)
  reward_fn = rewards.get_reward_fn(cfg.reward)
  records = load_prompts(cfg.prompts_path, cfg.prompts_format, limit=cfg.limit or None)
  if not records:
    raise ValueError(f"prompts_path={cfg.prompts_path!r}: no prompts to label")
  ref_tok = load_tokenizer(cfg.reference_path)
  prop_tok = load_tokenizer(cfg.proposal_path)
  prompting.check_same_vocabulary(ref_tok, prop_tok)
  ref_texts, ref_ids, prop_ids = _encode_all(cfg, records, ref_tok, prop_tok)
  prompts = [collect.Stage1Prompt(r.prompt_id, text, ids, r.reward_meta())
             for r, text, ids in zip(records, ref_texts, ref_ids)]
  sampling = dataclasses.replace(
      cfg.sampling, stop_token_ids=cfg.sampling.stop_token_ids or stop_ids.stop_token_ids(
          prop_tok, cfg.proposal_path, chat_template=cfg.rendering == "chat_template"),
      return_raw_logprobs=cfg.proposal_logprobs == "raw")
  with Stage1Writer(cfg.dataset_path(), cfg.dataset_format) as writer:
    before = writer.completed_ids()
    run: dict[str, float] = {"prompts_done": 0, "prompts_skipped": len(prompts), "samples": 0,
                             "seconds": 0.0, "samples_per_s": 0.0}
    if any(p.prompt_id not in before for p in prompts):
      run = _collect(cfg, writer, prompts, ref_tok, dict(zip(ref_ids, prop_ids)), reward_fn,
                     sampling)
      if run["preempted"]:
        print(f"stage1: preempted ({preemption.requested()}) after {run['prompts_done']} prompts; "
              f"rerun the command to resume", flush=True)
        return Stage1Result(output_dir=out_dir, dataset=cfg.dataset_path(), preempted=True,
                            run=run, stop_token_ids=(), diagnostics=None)
  return _finish(cfg, out_dir, prompts, before, run, sampling.stop_token_ids)


def _collect(cfg: Stage1Config, writer, prompts, ref_tok, prop_ids: dict, reward_fn,
             sampling) -> dict[str, float]:
  """Starts the scorer and the engine, labels the prompts not yet in ``writer``; the run's figures."""
  t0 = time.time()
  scorer = SequenceScorer(load_reference(cfg.reference_path, cfg.scorer),
                          pad_id=int(ref_tok.pad_token_id), batch_size=cfg.scorer.batch_size,
                          row_len=cfg.scorer.row_len, packing=cfg.scorer.packing,
                          pad_to=cfg.scorer.pad_to, chunk_size=cfg.scorer.chunk_size)
  engine = cfg.engine.make(cfg.proposal_path)
  startup_s = time.time() - t0
  try:
    run = collect.collect_stage1(
        engine=prompting.ProposalPromptEngine(engine, prop_ids),
        ref_scorer=scorer, prompts=prompts, reward_fn=reward_fn,
        decode=lambda ids: ref_tok.decode(ids, skip_special_tokens=True), sampling=sampling,
        beta=cfg.beta, reward_transform=cfg.reward_transform, writer=writer,
        label_scale=cfg.label_scale, proposal_logprobs=cfg.proposal_logprobs,
        prompts_per_batch=cfg.prompts_per_batch, progress=cfg.progress)
  finally:
    engine.close()
  run["startup_s"] = startup_s
  return run


def _finish(cfg: Stage1Config, out_dir: Path, prompts, before, run,
            stop_token_ids: tuple[int, ...]) -> Stage1Result:
  """Checks that every prompt is labelled, writes and returns the summary."""
  data = load_stage1(cfg.dataset_path(), cfg.dataset_format)
  run["generated_tokens"] = int(sum(s.num_tokens for pid, samples in zip(data.prompt_ids,
                                                                       data.samples)
                                    if pid not in before for s in samples))
  run["tokens_per_s"] = run["generated_tokens"] / run["seconds"] if run["seconds"] > 0 else 0.0
  missing = sorted(set(p.prompt_id for p in prompts) - set(data.prompt_ids))
  if missing:
    raise RuntimeError(f"Stage 1 finished but {len(missing)} prompt(s) are not in the dataset: "
                       f"{missing[:10]}")
  summary = stage1_summary(data, run)
  result = Stage1Result(output_dir=out_dir, dataset=cfg.dataset_path(), preempted=False,
                        run=summary["run"], stop_token_ids=tuple(int(t) for t in stop_token_ids),
                        diagnostics=codec.decode(Stage1Diagnostics, summary, "stage1_summary"))
  result.save()
  return result
