"""The Stage 1 dataset: one record per prompt with its N proposal samples, labels and diagnostics.

Record schema (DESIGN.md), one JSON object per line (``.jsonl``) or one row per prompt in parquet part
files (a directory of ``part-NNNNNN.parquet``):

    prompt_id         str, unique
    prompt            str
    samples           list of N >= 1 objects:
        token_ids       list[int]   response tokens
        text            str         decoded response
        logp_ref        float       log pi_ref(o|q), trajectory sum (may be -inf, never NaN)
        logp_proposal   float       log p_T(o|q), trajectory sum, of the density actually sampled (finite)
        reward          float       raw verifier reward r(q, o) (finite)
        num_tokens      int         |o| >= 1, for the length-normalised scale
        grade_error     bool        optional: the grader raised or timed out (reward 0 then)
    log_z_is, log_z_gm, ess, cv2, max_weight_share   float (labels and diagnostics; NaN allowed)
    n_valid           int
    beta              float > 0
    reward_transform  dict (codec.encode(RewardTransform))
    label_scale       'sum' | 'mean'     scale of the log-prob terms in the label
    proposal_logprobs 'processed' | 'raw' which proposal density was used

Writes are append-only and resumable: `Stage1Writer.completed_ids()` tells a rerun which prompts to
skip, each `write` call is flushed and fsync'ed (jsonl) or written to a temporary part file that is
hard-linked to a part name no part has yet (the highest index + 1; a link never replaces a file), so
a killed run loses at most the prompts in flight and never a finished part. A jsonl file whose last
line was cut by a crash is repaired on open (the partial line is dropped and reported). A write the
file system refuses (a full disk, a read-only directory) raises `OutputWriteError` naming the file
(`disa_jax.checkpoint.files`); a parquet part that could not be written is removed, the parts
before it are intact, and a rerun labels its prompts. A writer
holds an exclusive lock (`disa_jax.checkpoint.lock`, ``<dataset>.lock`` beside a jsonl file,
``.lock`` inside a part directory) from open to `close` or the end of its process: a second writer
gets `OutputLockedError` naming the holder's pid. The dataset may be a URL (``gs://``,
`disa_jax.paths`): a part is then written under its temporary name and copied to its part name, an
append rewrites the jsonl object, and the lock excludes the writers of this machine only.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
import warnings
from typing import Any, Iterable, Sequence

import numpy as np

from disa_jax import codec, paths
from disa_jax.checkpoint.files import OutputWriteError, naming
from disa_jax.checkpoint.lock import OutputLock
from disa_jax.data import parquet
from disa_jax.estimators.importance import log_importance_weights, stage1_statistics
from disa_jax.estimators.reward_transforms import RewardTransform

LABEL_SCALES = ("sum", "mean")
PROPOSAL_LOGPROBS = ("processed", "raw")
SAMPLE_FIELDS = ("token_ids", "text", "logp_ref", "logp_proposal", "reward", "num_tokens")
STAT_FIELDS = ("log_z_is", "log_z_gm", "ess", "cv2", "max_weight_share")
_PART_RE = re.compile(r"^part-(\d+)\.parquet$")


class Stage1FormatError(ValueError):
  """A Stage 1 file has invalid rows; ``errors`` lists (row index, reason)."""

  def __init__(self, path: str, errors: list[tuple[int, str]]):
    self.path, self.errors = path, errors
    shown = "\n".join(f"  row {i}: {why}" for i, why in errors[:20])
    more = f"\n  ... and {len(errors) - 20} more" if len(errors) > 20 else ""
    super().__init__(f"{path}: {len(errors)} invalid Stage 1 row(s):\n{shown}{more}")

  def __reduce__(self):  # (pickled back from a worker process with its arguments)
    return type(self), (self.path, self.errors)


def scaled_logps(logp: np.ndarray, num_tokens: np.ndarray, label_scale: str) -> np.ndarray:
  """Trajectory log-probs on the requested scale: the sum, or the sum / |o| ('mean')."""
  if label_scale not in LABEL_SCALES:
    raise ValueError(f"label_scale must be one of {LABEL_SCALES}, got {label_scale!r}")
  if label_scale == "sum":
    return logp
  return logp / np.maximum(num_tokens, 1)


def build_records(prompt_ids: Sequence[str],
                  prompts: Sequence[str],
                  samples: Sequence[Sequence[dict[str, Any]]],
                  *,
                  beta: float,
                  reward_transform: RewardTransform,
                  label_scale: str = "sum",
                  proposal_logprobs: str = "processed") -> list[dict[str, Any]]:
  """Computes labels and diagnostics for a batch of prompts and returns Stage 1 records.

  Args:
    prompt_ids: P unique ids.
    prompts: P prompt strings.
    samples: P lists of sample dicts with the fields of ``SAMPLE_FIELDS`` (N may differ per prompt).
    beta: inverse temperature (> 0).
    reward_transform: transform applied to the raw rewards before weighting, per prompt group.
    label_scale: 'sum' (the paper's trajectory residual) or 'mean' (length-normalised, FlowRL's code).
    proposal_logprobs: which proposal density ``logp_proposal`` holds.

  Returns:
    P record dicts (see module docstring).
  """
  if not beta > 0:
    raise ValueError(f"beta must be > 0, got {beta!r}")
  if proposal_logprobs not in PROPOSAL_LOGPROBS:
    raise ValueError(f"proposal_logprobs must be one of {PROPOSAL_LOGPROBS}, got {proposal_logprobs!r}")
  if not (len(prompt_ids) == len(prompts) == len(samples)):
    raise ValueError(f"prompt_ids, prompts and samples differ in length: "
                     f"{len(prompt_ids)}, {len(prompts)}, {len(samples)}")
  arr = _pad_samples(samples)
  r_t = np.asarray(reward_transform.apply(arr["reward"], arr["mask"]))
  lw = log_importance_weights(scaled_logps(arr["logp_ref"], arr["num_tokens"], label_scale),
                              scaled_logps(arr["logp_proposal"], arr["num_tokens"], label_scale),
                              r_t, beta, arr["mask"])
  stats = {k: np.asarray(v) for k, v in stage1_statistics(lw, arr["mask"]).items()}
  out = []
  for i, (pid, prompt, ss) in enumerate(zip(prompt_ids, prompts, samples)):
    rec = {"prompt_id": str(pid), "prompt": prompt, "samples": [_clean_sample(s) for s in ss]}
    rec.update({k: float(stats[k][i]) for k in STAT_FIELDS})
    rec.update({"n_valid": int(stats["n_valid"][i]), "beta": float(beta),
                "reward_transform": codec.encode(reward_transform), "label_scale": label_scale,
                "proposal_logprobs": proposal_logprobs})
    out.append(rec)
  return out


def _clean_sample(s: dict[str, Any]) -> dict[str, Any]:
  missing = [f for f in SAMPLE_FIELDS if f not in s]
  if missing:
    raise ValueError(f"sample is missing fields {missing}: {sorted(s)}")
  out = {"token_ids": [int(t) for t in s["token_ids"]], "text": str(s["text"]),
         "logp_ref": float(s["logp_ref"]), "logp_proposal": float(s["logp_proposal"]),
         "reward": float(s["reward"]), "num_tokens": int(s["num_tokens"])}
  if "grade_error" in s:
    out["grade_error"] = bool(s["grade_error"])
  return out


def _pad_samples(samples: Sequence[Sequence[dict[str, Any]]]) -> dict[str, np.ndarray]:
  """Pads ragged per-prompt sample lists to ``[P, Nmax]`` arrays plus a validity mask."""
  p = len(samples)
  nmax = max((len(s) for s in samples), default=0)
  out = {k: np.zeros((p, max(nmax, 1)), np.float32) for k in ("logp_ref", "logp_proposal", "reward")}
  out["num_tokens"] = np.ones((p, max(nmax, 1)), np.int32)
  out["mask"] = np.zeros((p, max(nmax, 1)), bool)
  for i, ss in enumerate(samples):
    for j, s in enumerate(ss):
      for k in ("logp_ref", "logp_proposal", "reward"):
        out[k][i, j] = float(s[k])
      out["num_tokens"][i, j] = int(s["num_tokens"])
      out["mask"][i, j] = True
  return out


# ------------------------------------------------------------------------------------------------
# Writing (append-only, resumable)
# ------------------------------------------------------------------------------------------------


def _json_default(o):
  if isinstance(o, (np.floating, np.integer)):
    return o.item()
  raise TypeError(f"not JSON serialisable: {type(o).__name__}")


class Stage1Writer:
  """Append-only, resumable, exclusive writer of Stage 1 records.

  Args:
    path: a ``.jsonl`` file, or a directory (created) of parquet part files when ``fmt='parquet'``.
    fmt: 'jsonl' | 'parquet' | 'auto' (by suffix: ``.jsonl`` -> jsonl, anything else -> parquet).

  Raises:
    OutputLockedError: another writer (this process or another) holds the dataset.
  """

  def __init__(self, path: str | os.PathLike, fmt: str = "auto"):
    self.path = paths.as_path(path)
    if fmt == "auto":
      fmt = "jsonl" if self.path.suffix == ".jsonl" else "parquet"
    if fmt not in ("jsonl", "parquet"):
      raise ValueError(f"fmt must be 'jsonl', 'parquet' or 'auto', got {fmt!r}")
    self.fmt = fmt
    self.repaired_lines = 0
    if fmt == "jsonl":
      self.path.parent.mkdir(parents=True, exist_ok=True)
      lock_file = self.path.with_name(self.path.name + ".lock")
    else:
      self.path.mkdir(parents=True, exist_ok=True)
      lock_file = self.path / ".lock"
    self._lock = OutputLock(lock_file, f"the Stage 1 dataset {self.path}")
    if fmt == "jsonl":
      self._repair_jsonl_tail()
    else:
      for tmp in self.path.glob("*.parquet.tmp"):  # a part that was being written when a run was killed
        tmp.unlink()
    self._done = set(_iter_ids(self.path, fmt))

  def close(self) -> None:
    """Releases the lock (idempotent); a closed writer refuses to write."""
    self._lock.release()

  def __enter__(self) -> "Stage1Writer":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def _repair_jsonl_tail(self) -> None:
    if not self.path.exists():
      return
    data = self.path.read_bytes()
    if not data or data.endswith(b"\n"):
      return
    cut = data.rfind(b"\n") + 1  # keep every complete line
    warnings.warn(f"{self.path}: dropping a partial last line of {len(data) - cut} bytes left by an "
                  f"interrupted run; that prompt will be recomputed")
    paths.truncate(self.path, cut)
    self.repaired_lines = 1

  def completed_ids(self) -> set[str]:
    """prompt_ids already written (a rerun skips them)."""
    return set(self._done)

  def write(self, records: Iterable[dict[str, Any]]) -> int:
    """Appends records durably; raises on a duplicate prompt_id. Returns the number written.

    Raises:
      OutputWriteError: the file system refused the write (its message names the file).
    """
    if not self._lock.held:
      raise RuntimeError(f"Stage1Writer({self.path}) is closed")
    records = list(records)
    ids = [r["prompt_id"] for r in records]
    dup = sorted(set(i for i in ids if i in self._done) | set(i for i in ids if ids.count(i) > 1))
    if dup:
      raise ValueError(f"duplicate prompt_id(s) for {self.path}: {dup[:10]}")
    if not records:
      return 0
    if self.fmt == "jsonl":
      lines = "".join(json.dumps(r, default=_json_default, allow_nan=True) + "\n" for r in records)
      with naming(self.path, "the Stage 1 dataset"):
        paths.append(self.path, lines)  # a cut write leaves a partial last line: repaired next
    else:
      self._write_part(records)
    self._done.update(ids)
    return len(records)

  def _write_part(self, records: list[dict[str, Any]]) -> None:
    """One new parquet part: written and fsync'ed under a temporary name, then hard-linked to the
    first free part name (`paths.link_new` fails rather than replace an existing part)."""
    rows = [dict(r, reward_transform=json.dumps(r["reward_transform"])) for r in records]
    k = 1 + max((int(m.group(1)) for p in self.path.iterdir() if (m := _PART_RE.match(p.name))),
                default=-1)
    tmp = self.path / f"part-{k:06d}.parquet.tmp"
    try:
      with naming(tmp, "a Stage 1 dataset part"):
        with tmp.open("wb") as f:
          parquet.write_rows(rows, f)
        paths.sync(tmp)
    except OutputWriteError:
      tmp.unlink(missing_ok=True)  # (a killed run's is removed by the next writer)
      raise
    while True:
      try:
        paths.link_new(tmp, self.path / f"part-{k:06d}.parquet")
        break
      except FileExistsError:
        k += 1
    tmp.unlink()


def _iter_raw(path: paths.AnyPath, fmt: str) -> Iterable[tuple[int, Any, str]]:
  """Yields (row index, raw record or an Exception for an unparseable row, the file holding it)."""
  if fmt == "jsonl":
    if not path.exists():
      return
    with path.open(encoding="utf-8") as f:
      for i, line in enumerate(f):
        try:
          yield i, json.loads(line), path.name
        except json.JSONDecodeError as e:
          yield i, e, path.name
  else:
    i = 0
    for part in sorted(path.glob("part-*.parquet")):
      with part.open("rb") as f:
        rows = parquet.read_rows(f)
      for row in rows:
        if isinstance(row.get("reward_transform"), str):
          try:
            row["reward_transform"] = json.loads(row["reward_transform"])
          except json.JSONDecodeError as e:
            row["reward_transform"] = e
        yield i, row, part.name
        i += 1


def _iter_ids(path: paths.AnyPath, fmt: str) -> Iterable[str]:
  for _, r, _ in _iter_raw(path, fmt):
    if isinstance(r, dict) and "prompt_id" in r:
      yield str(r["prompt_id"])


# ------------------------------------------------------------------------------------------------
# Loading with validation
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Stage1Sample:
  """One proposal sample of a Stage 1 record, typed.

  Attributes:
    token_ids: ``[L]`` the response's token ids (the stop token included when it stopped).
    text: the decoded response.
    logp_ref, logp_proposal: trajectory log-probs under pi_ref and the proposal (sums over tokens).
    reward: the raw verifier reward.
    num_tokens: L.
    grade_error: the grader raised or timed out (reward 0 there).
  """
  token_ids: tuple[int, ...]
  text: str
  logp_ref: float
  logp_proposal: float
  reward: float
  num_tokens: int
  grade_error: bool = False

  @classmethod
  def from_record(cls, s: dict[str, Any]) -> "Stage1Sample":
    """From a validated record's sample (`_check_record`)."""
    return cls(tuple(int(t) for t in s["token_ids"]), s["text"], float(s["logp_ref"]),
               float(s["logp_proposal"]), float(s["reward"]), int(s["num_tokens"]),
               bool(s.get("grade_error", False)))


@dataclasses.dataclass(frozen=True, eq=False)
class Stage1Stats:
  """The per-prompt statistics a Stage 1 dataset stores beside its samples (`stage1_statistics`
  when it was written; NaN where a row stored none), each ``[P]``."""
  log_z_is: np.ndarray  # [P] the log Z_IS labels (eq. 8)
  log_z_gm: np.ndarray  # [P] the geometric-mean variant
  ess: np.ndarray  # [P] effective sample size of the importance weights
  cv2: np.ndarray  # [P] squared coefficient of variation of the weights
  max_weight_share: np.ndarray  # [P] the largest normalised weight
  n_valid: np.ndarray  # [P] int: the prompt's samples


@dataclasses.dataclass
class Stage1Data:
  """A validated Stage 1 dataset as padded arrays (P prompts, up to N samples each), its samples
  typed (``samples[p][i]``, `Stage1Sample`) and the raw rows as read (``records``, for byte-level
  comparisons only: later stages read ``samples``)."""

  prompt_ids: list[str]
  prompts: list[str]
  logp_ref: np.ndarray  # [P, N] trajectory sums
  logp_proposal: np.ndarray  # [P, N] trajectory sums
  reward: np.ndarray  # [P, N] raw verifier rewards
  num_tokens: np.ndarray  # [P, N]
  mask: np.ndarray  # [P, N] bool
  stats: Stage1Stats  # each [P], as stored
  beta: float
  reward_transform: RewardTransform
  label_scale: str
  proposal_logprobs: str
  records: list[dict[str, Any]]
  grade_error: np.ndarray | None = None  # [P, N] bool: the grader raised or timed out; None: never

  @functools.cached_property
  def samples(self) -> list[list[Stage1Sample]]:
    """``[P][n_p]`` the typed samples of each prompt, in file order."""
    return [[Stage1Sample.from_record(x) for x in r["samples"]] for r in self.records]

  @property
  def labels(self) -> np.ndarray:
    """``[P]`` stored log Z_IS labels (eq. 8)."""
    return self.stats.log_z_is

  def log_weights(self, label_scale: str | None = None, beta: float | None = None) -> np.ndarray:
    """``[P, N]`` log importance weights (w of eq. 7) recomputed on the given scale and at the given beta
    (defaults: the stored ones)."""
    scale = label_scale or self.label_scale
    beta = self.beta if beta is None else float(beta)
    if not beta > 0:
      raise ValueError(f"beta must be > 0, got beta={beta!r}")
    r_t = self.reward_transform.apply(self.reward, self.mask)
    return np.asarray(log_importance_weights(scaled_logps(self.logp_ref, self.num_tokens, scale),
                                             scaled_logps(self.logp_proposal, self.num_tokens, scale),
                                             r_t, beta, self.mask))


def _check_record(r: Any) -> str | None:
  """Returns the reason a raw record is invalid, or None."""
  if isinstance(r, Exception):
    return f"not valid JSON ({r})"
  if not isinstance(r, dict):
    return f"not an object: {type(r).__name__}"
  for f in ("prompt_id", "prompt", "samples", "beta", "reward_transform", "label_scale", "proposal_logprobs"):
    if f not in r:
      return f"missing field {f!r}"
  if not isinstance(r["prompt_id"], str) or not r["prompt_id"]:
    return f"prompt_id must be a non-empty string, got {r['prompt_id']!r}"
  if not isinstance(r["prompt"], str):
    return f"prompt must be a string, got {type(r['prompt']).__name__}"
  if not isinstance(r["beta"], (int, float)) or not r["beta"] > 0:
    return f"beta must be a number > 0, got {r['beta']!r}"
  if r["label_scale"] not in LABEL_SCALES:
    return f"label_scale must be one of {LABEL_SCALES}, got {r['label_scale']!r}"
  if r["proposal_logprobs"] not in PROPOSAL_LOGPROBS:
    return f"proposal_logprobs must be one of {PROPOSAL_LOGPROBS}, got {r['proposal_logprobs']!r}"
  try:
    codec.decode(RewardTransform, r["reward_transform"], "reward_transform")
  except (TypeError, ValueError) as e:
    return f"reward_transform invalid: {e}"
  for f in STAT_FIELDS:  # optional (NaN when absent or null); a stored value must be a number
    v = r.get(f)
    if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool)):
      return f"{f}={v!r} is not a number"
  if "n_valid" in r and (not isinstance(r["n_valid"], int) or isinstance(r["n_valid"], bool)
                         or r["n_valid"] < 0):
    return f"n_valid={r['n_valid']!r} is not an int >= 0"
  ss = r["samples"]
  if not isinstance(ss, list) or not ss:
    return "samples must be a non-empty list"
  for j, s in enumerate(ss):
    if not isinstance(s, dict):
      return f"samples[{j}] is not an object"
    for f in SAMPLE_FIELDS:
      if f not in s:
        return f"samples[{j}] missing field {f!r}"
    for f in ("logp_ref", "logp_proposal", "reward"):
      v = s[f]
      if not isinstance(v, (int, float)) or isinstance(v, bool) or math.isnan(v):
        return f"samples[{j}].{f} must be a number, got {v!r}"
    if math.isinf(s["logp_proposal"]) or math.isinf(s["reward"]) or s["logp_ref"] == math.inf:
      return f"samples[{j}]: logp_proposal and reward must be finite and logp_ref < inf"
    if not isinstance(s["num_tokens"], int) or s["num_tokens"] < 1:
      return f"samples[{j}].num_tokens must be an int >= 1, got {s['num_tokens']!r}"
    if not isinstance(s["token_ids"], list) or not all(isinstance(t, int) for t in s["token_ids"]):
      return f"samples[{j}].token_ids must be a list of ints"
    if not isinstance(s["text"], str):
      return f"samples[{j}].text must be a string"
  return None


def load_stage1(path: str | os.PathLike, fmt: str = "auto") -> Stage1Data:
  """Loads and validates a Stage 1 dataset (local or a URL).

  Every row is checked; all invalid rows are reported together in a `Stage1FormatError` with their
  index and reason. Rows must agree on beta, reward transform, label scale and proposal log-probs.
  """
  path = paths.as_path(path)
  if fmt == "auto":
    fmt = "jsonl" if path.suffix == ".jsonl" else "parquet"
  if not path.exists():
    raise FileNotFoundError(f"Stage 1 dataset not found: {path}")
  errors: list[tuple[int, str]] = []
  good: list[dict[str, Any]] = []
  seen: dict[str, int] = {}
  for i, r, where in _iter_raw(path, fmt):
    why = _check_record(r)
    if why is None and r["prompt_id"] in seen:
      why = f"duplicate prompt_id {r['prompt_id']!r} (first at row {seen[r['prompt_id']]})"
    if why is not None:
      errors.append((i, f"{why} (in {where})" if fmt == "parquet" else why))
      continue
    seen[r["prompt_id"]] = i
    good.append(r)
  if good:
    ref = good[0]
    for i, r in enumerate(good):
      for f in ("beta", "reward_transform", "label_scale", "proposal_logprobs"):
        if r[f] != ref[f]:
          errors.append((seen[r["prompt_id"]], f"{f}={r[f]!r} differs from the first row's {ref[f]!r}"))
  if errors:
    raise Stage1FormatError(str(path), sorted(errors))
  if not good:
    raise ValueError(f"{path}: the Stage 1 dataset is empty")
  arr = _pad_samples([r["samples"] for r in good])
  grade_error = np.zeros_like(arr["mask"])
  for i, r in enumerate(good):
    grade_error[i, :len(r["samples"])] = [bool(s.get("grade_error", False)) for s in r["samples"]]
  stats = Stage1Stats(**{k: np.asarray([np.nan if r.get(k) is None else r[k] for r in good],
                                        np.float64) for k in STAT_FIELDS},
                      n_valid=arr["mask"].sum(-1))
  return Stage1Data(prompt_ids=[r["prompt_id"] for r in good], prompts=[r["prompt"] for r in good],
                    logp_ref=arr["logp_ref"], logp_proposal=arr["logp_proposal"], reward=arr["reward"],
                    num_tokens=arr["num_tokens"], mask=arr["mask"], grade_error=grade_error,
                    stats=stats, beta=float(ref["beta"]),
                    reward_transform=codec.decode(RewardTransform, ref["reward_transform"],
                                                  "reward_transform"),
                    label_scale=ref["label_scale"], proposal_logprobs=ref["proposal_logprobs"],
                    records=good)
