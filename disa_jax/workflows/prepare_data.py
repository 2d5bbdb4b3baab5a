"""The paper's training sets and benchmarks -> the files the configs read, with their provenance.

`prepare(name, source, ...)` reads one set from a local file (.jsonl / .json / .parquet), a Hugging
Face dataset directory (written by ``Dataset.save_to_disk``, or a downloaded hub repository: both
read with the `datasets` package, the ``data`` extra) or a hub name (where the machine is online),
checks every row with the loader of its format (`disa_jax.tasks.prompts`: a bad row stops the
command, naming the set, the part, the row and the field), writes the rows as they are (every
column; a set of several dataset configs concatenated) as parquet or jsonl by the output's
extension: DAPO-17k-processed in veRL columns, DeepCoder in rllm's (problem, tests, metadata), the
benchmarks in theirs, each the format its loader reads (the configs read them with format 'auto'
or the benchmark's name; the paper's prompt templates are applied when they are read). The output
is read back as the configs read it (unique prompt ids), and beside it goes
``<output>.provenance.json``: the set, the source and its kind, the dataset config(s), split and
requested revision, the `datasets` fingerprint (Hugging Face inputs) or the input file's sha256, the
rows read and written, and the output's sha256. `SETS` names where each set comes from (the
defaults of `launch/prepare_data.py`; docs/real_checkpoints.md lists them).

A source that looks like a local path (absolute, ``./`` / ``../`` / ``~``-relative, a file suffix,
or a parent directory that exists here) and is missing is an error naming it, never a hub name.
A hub name is read only when the hub answers (`hub_problem`: one request, a few seconds): offline,
the command stops at once with the way out (``--source`` = a downloaded copy, or
``HF_HUB_OFFLINE=1`` to read the hub's copy from the local cache). `plan` is the dry run: every
check, nothing read or written.
"""
from __future__ import annotations

import dataclasses
import json
import os
import urllib.error
import urllib.request
from typing import Any, Sequence

from disa_jax.data.rows import read_rows
from disa_jax.tasks.prompts import load_prompts, records_from_rows
from disa_jax.workflows.split_validation import file_sha256, write_rows


@dataclasses.dataclass(frozen=True)
class SetSpec:
  """Where one of the paper's sets comes from and where the configs read it.

  Attributes:
    hub: its Hugging Face hub name (the default source).
    configs: the hub dataset's configs to concatenate (('',): its only one).
    split: the split read.
    fmt: the loader format of its rows (`disa_jax.tasks.prompts.formats()`).
    output: the file the configs read (configs/common.py, configs/eval_paper.py).
  """
  hub: str
  configs: tuple[str, ...]
  split: str
  fmt: str
  output: str


TRAINING_SETS = {
    # DAPO-Math-17k deduplicated by prompt (veRL columns; `prompt` the user text), English config.
    "dapo-17k-processed": SetSpec("open-r1/DAPO-Math-17k-Processed", ("en",), "train", "verl",
                                  "data/dapo-17k-processed.parquet"),
    # DeepCoder's training problems (rllm rows: problem, tests, metadata) from its three sources.
    "deepcoder": SetSpec("agentica-org/DeepCoder-Preview-Dataset",
                         ("primeintellect", "taco", "lcbv5"), "train", "rllm_code",
                         "data/deepcoder.parquet"),
}
BENCHMARKS = {
    "aime24": SetSpec("HuggingFaceH4/aime_2024", ("",), "train", "math",
                      "data/benchmarks/aime24.jsonl"),
    "aime25": SetSpec("math-ai/aime25", ("",), "test", "math", "data/benchmarks/aime25.jsonl"),
    "amc23": SetSpec("math-ai/amc23", ("",), "test", "math", "data/benchmarks/amc23.jsonl"),
    "math500": SetSpec("HuggingFaceH4/MATH-500", ("",), "test", "math",
                       "data/benchmarks/math500.jsonl"),
    "humanevalplus": SetSpec("evalplus/humanevalplus", ("",), "test", "humanevalplus",
                             "data/benchmarks/humanevalplus.jsonl"),
}
SETS = {**TRAINING_SETS, **BENCHMARKS}
FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".jsonl.gz", ".json.gz")


@dataclasses.dataclass(frozen=True)
class Part:
  """The rows of one dataset config (or of a file) and what identifies them."""
  rows: list[dict[str, Any]]
  where: str  # for messages: the source, config and split
  config: str
  identity: str  # the datasets fingerprint, or the file's sha256


def looks_local(source: str) -> bool:
  """Whether ``source`` names a local path rather than a hub name (``ORG/NAME``): absolute,
  ``./`` / ``../`` / ``~``-relative, a data file's suffix, or a parent directory existing here."""
  if source.startswith(("/", "./", "../", "~")) or source.endswith(FILE_SUFFIXES):
    return True
  parent = os.path.dirname(source)
  return bool(parent) and os.path.isdir(parent)


def source_kind(source: str) -> str:
  """'file', 'hf_dir' (a local directory) or 'hub' (a hub name).

  Raises:
    FileNotFoundError: ``source`` looks like a local path (`looks_local`) that does not exist.
  """
  if os.path.isfile(source):
    return "file"
  if os.path.isdir(source):
    return "hf_dir"
  if looks_local(source):
    raise FileNotFoundError(f"source={source!r}: no such file or directory (a local path; a "
                            "Hugging Face hub name is ORG/NAME)")
  return "hub"


def hub_problem(timeout_s: float = 5.0) -> str | None:
  """Why the Hugging Face hub cannot be read now, or None: ``HF_HUB_OFFLINE`` unset and one HEAD
  request to the endpoint (``HF_ENDPOINT``, the proxies of the environment) answered in time."""
  if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
    return None  # the user asked for the local cache: datasets reads it
  endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
  try:
    urllib.request.urlopen(urllib.request.Request(endpoint, method="HEAD"), timeout=timeout_s)
  except urllib.error.HTTPError:
    return None  # it answered
  except (urllib.error.URLError, OSError) as e:
    return f"{endpoint} did not answer ({getattr(e, 'reason', e)})"
  return None


class SourceUnavailableError(ValueError):
  """A hub source that cannot be read here; the message says what to pass instead."""

  def __init__(self, source: str, why: str):
    self.source, self.why = source, why
    super().__init__(
        f"source={source!r} is a Hugging Face hub name and {why}: download the set where the hub "
        "is reachable and pass --source=<its file or dataset directory>, or set HF_HUB_OFFLINE=1 "
        "to read the hub's copy from the local cache")

  def __reduce__(self):  # (pickled back from a worker process with its arguments)
    return type(self), (self.source, self.why)


def _check_source(source: str) -> str:
  """`source_kind`, and for a hub name that the hub answers (`SourceUnavailableError`)."""
  kind = source_kind(source)
  if kind == "hub" and (why := hub_problem()) is not None:
    raise SourceUnavailableError(source, why)
  return kind


def _hf_rows(source: str, kind: str, config: str, split: str, revision: str | None) -> Part:
  """One split of a Hugging Face dataset directory or hub dataset."""
  import datasets  # pylint: disable=g-import-not-at-top  # optional: the 'data' extra
  where = f"{source}{f' [{config}]' if config else ''} split {split!r}"
  if kind == "hf_dir" and os.path.exists(os.path.join(source, "dataset_dict.json")):
    ds = datasets.load_from_disk(source)
    if split not in ds:
      raise ValueError(f"{source}: no split {split!r} (splits: {sorted(ds)})")
    ds = ds[split]
  elif kind == "hf_dir" and os.path.exists(os.path.join(source, "state.json")):
    ds = datasets.load_from_disk(source)  # one saved split
  elif kind == "hf_dir":  # a downloaded hub repository
    ds = datasets.load_dataset(source, config or None, split=split, revision=revision)
  else:
    try:
      ds = datasets.load_dataset(source, config or None, split=split, revision=revision)
    except (ConnectionError, FileNotFoundError) as e:  # offline without a cached copy
      raise SourceUnavailableError(source, f"it could not be read ({' '.join(str(e).split())})"
                                   ) from e
  return Part(ds.to_list(), where, config, ds._fingerprint)  # pylint: disable=protected-access


def read_parts(spec: SetSpec, source: str, *, configs: Sequence[str] | None = None,
               split: str | None = None, revision: str | None = None) -> list[Part]:
  """The rows of ``source`` for a set, one `Part` per dataset config (`plan` checked it)."""
  kind = source_kind(source)
  if kind == "file":
    return [Part(read_rows(source), source, "", file_sha256(source))]
  return [_hf_rows(source, kind, c, split or spec.split, revision)
          for c in (spec.configs if configs is None else configs)]


def _check_rows(name: str, spec: SetSpec, parts: Sequence[Part]) -> None:
  """Every part's rows through the set's loader: a bad row is named with its part and row."""
  for part in parts:
    if not part.rows:
      raise ValueError(f"{name}: {part.where} has no rows")
    records_from_rows(part.rows, spec.fmt, where=f"{name}: {part.where}", data_source=name)


def plan(name: str, source: str = "", output: str = "", *,
         configs: Sequence[str] | None = None, split: str | None = None,
         revision: str | None = None) -> dict[str, Any]:
  """What `prepare` would do, every check made (the set, the source: a local path that exists or a
  hub name the hub answers, the output's format), nothing read or written: the dry run.

  Returns:
    The set, the source and its kind, the dataset configs, split and revision, the loader format
    and the output path (absolute).

  Raises:
    ValueError: an unknown set or output format; `SourceUnavailableError` (a ValueError): a hub
      name while the hub does not answer.
    FileNotFoundError: a local-looking source that does not exist.
  """
  if name not in SETS:
    raise ValueError(f"set must be one of {sorted(SETS)}, got {name!r}")
  spec = SETS[name]
  source, output = source or spec.hub, output or spec.output
  if not output.endswith((".parquet", ".jsonl")):
    raise ValueError(f"{output}: output must end in .parquet or .jsonl")
  kind = _check_source(source)
  return {"set": name, "source": source, "source_kind": kind,
          "configs": [""] if kind == "file" else list(spec.configs if configs is None else configs),
          "split": None if kind == "file" else split or spec.split, "revision": revision,
          "format": spec.fmt, "output": os.path.abspath(output)}


def prepare(name: str, source: str = "", output: str = "", *, configs: Sequence[str] | None = None,
            split: str | None = None, revision: str | None = None) -> dict[str, Any]:
  """Writes set ``name`` (a key of `SETS`) from ``source`` to ``output`` with its provenance.

  Args:
    name: the set.
    source: a local file, a Hugging Face dataset directory or a hub name ('' = the set's hub
      name).
    output: the .parquet / .jsonl file to write ('' = the path the configs read).
    configs, split: the dataset configs and split (None = the set's).
    revision: the hub revision (branch, tag or commit) to read; recorded as given.

  Returns:
    The provenance (also written to ``<output>.provenance.json``).
  """
  steps = plan(name, source, output, configs=configs, split=split, revision=revision)
  spec, source, output, kind = SETS[name], steps["source"], steps["output"], steps["source_kind"]
  parts = read_parts(spec, source, configs=configs, split=split, revision=revision)
  _check_rows(name, spec, parts)
  write_rows([row for part in parts for row in part.rows], output)
  try:  # read back as the configs read it (prompt ids unique across the parts)
    records = load_prompts(output, spec.fmt)
  except ValueError:
    os.remove(output)
    raise
  provenance = {
      "set": name, "source": source, "source_kind": kind, "configs": [p.config for p in parts],
      "split": None if kind == "file" else split or spec.split, "revision": revision,
      "identity": {p.config or "file": p.identity for p in parts},
      "rows_read": sum(len(p.rows) for p in parts), "rows_written": len(records),
      "format": spec.fmt, "output": os.path.abspath(output), "sha256": file_sha256(output)}
  with open(output + ".provenance.json", "w", encoding="utf-8") as f:
    json.dump(provenance, f, indent=1)
  return provenance
