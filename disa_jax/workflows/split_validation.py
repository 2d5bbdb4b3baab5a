"""A held-out validation subset of the training prompts, for the paper's checkpoint selection.

The paper reports, per method, the checkpoint best on "a held-out validation subset of the
training corpus" (App. D, "Checkpoint selection"). `split_validation` takes ``size`` prompts out of
a prompt file: each row is keyed by ``sha256(seed, prompt, ground truth)`` and the ``size``
smallest keys form the validation subset, so the split depends on the rows' content and the seed
only, not on their order or on the file's other rows (a reordered or reshuffled copy gives the same
split; rows of identical content always land on the same side, so the validation set may exceed
``size`` by such duplicates, counted in the manifest). Both parts keep the source rows as they are
(every column), in file order, as parquet or jsonl by their extension; Stage 1, Stage 2 and Stage 3
train on the train part, Stage 3 validates on the other (`configs/common.py`). A manifest beside the
validation file records the source (path, sha256, rows), the seed, the sizes, the outputs' sha256
and the validation prompt ids. `launch/split_validation.py` is the command.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Any, Sequence

from disa_jax import codec
from disa_jax.data import parquet
from disa_jax.data.records import PromptRecord
from disa_jax.data.rows import read_rows
from disa_jax.tasks.prompts import load_prompts


@dataclasses.dataclass(frozen=True)
class SplitManifest:
  """What `split_validation` wrote (also as JSON in `manifest_path`)."""
  source: str
  source_sha256: str
  source_rows: int
  seed: int
  size: int
  train_path: str
  train_rows: int
  train_sha256: str
  validation_path: str
  validation_rows: int
  validation_sha256: str
  validation_prompt_ids: tuple[str, ...]
  method: str = "the `size` smallest sha256(seed, prompt, ground truth) keys; duplicates together"


def file_sha256(path: str) -> str:
  """The sha256 of a file's bytes (hex)."""
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
      h.update(block)
  return h.hexdigest()


def manifest_path(validation_path: str) -> str:
  """Where `split_validation` writes the manifest of a validation file."""
  return validation_path + ".manifest.json"


def content_key(record: PromptRecord, seed: int) -> str:
  """The row's split key: sha256 over the seed, the prompt and the ground truth."""
  content = json.dumps([seed, record.prompt, record.ground_truth], sort_keys=True, default=str)
  return hashlib.sha256(content.encode("utf-8")).hexdigest()


def write_rows(rows: Sequence[dict[str, Any]], path: str) -> None:
  """Writes rows as parquet or jsonl by ``path``'s extension (directories are created)."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  tmp = path + ".tmp"
  if path.endswith(".parquet"):
    parquet.write_rows(rows, tmp)
  elif path.endswith(".jsonl"):
    with open(tmp, "w", encoding="utf-8") as f:
      f.write("".join(json.dumps(r, sort_keys=True, default=str) + "\n" for r in rows))
  else:
    raise ValueError(f"{path}: output must end in .parquet or .jsonl")
  os.replace(tmp, path)


def split_validation(path: str, train_path: str, validation_path: str, *, size: int, seed: int,
                     fmt: str = "auto") -> SplitManifest:
  """Splits ``size`` validation prompts from ``path``; writes both parts and the manifest.

  Args:
    path: the training prompt file (any `disa_jax.tasks.prompts` format; every row is validated).
    train_path, validation_path: the outputs (.parquet or .jsonl); neither may be ``path``.
    size: validation prompts (>= 1, fewer than the file's rows).
    seed: the split's seed (another seed, another split).
    fmt: the loader format of ``path``.

  Returns:
    The manifest (also written to `manifest_path(validation_path)`).
  """
  for name, out in (("train_path", train_path), ("validation_path", validation_path)):
    if os.path.abspath(out) == os.path.abspath(path):
      raise ValueError(f"{name}={out!r} is the input file; choose another path")
  rows = read_rows(path)
  records = load_prompts(path, fmt)
  if len(records) != len(rows):
    raise ValueError(f"{path}: {len(rows)} rows but {len(records)} prompts were read")
  if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size < len(rows):
    raise ValueError(f"size must be an int in [1, {len(rows) - 1}] for the {len(rows)} rows of "
                     f"{path}, got {size!r}")
  keys = [content_key(r, seed) for r in records]
  chosen = set(sorted(set(keys))[:size])
  val = [i for i, k in enumerate(keys) if k in chosen]
  train = [i for i, k in enumerate(keys) if k not in chosen]
  if not train:
    raise ValueError(f"{path}: every row would be a validation row (duplicates); lower size")
  write_rows([rows[i] for i in train], train_path)
  write_rows([rows[i] for i in val], validation_path)
  manifest = SplitManifest(
      source=os.path.abspath(path), source_sha256=file_sha256(path), source_rows=len(rows),
      seed=seed, size=size, train_path=os.path.abspath(train_path), train_rows=len(train),
      train_sha256=file_sha256(train_path), validation_path=os.path.abspath(validation_path),
      validation_rows=len(val), validation_sha256=file_sha256(validation_path),
      validation_prompt_ids=tuple(records[i].prompt_id for i in val))
  with open(manifest_path(validation_path), "w", encoding="utf-8") as f:
    json.dump(codec.encode(manifest), f, indent=1)
  return manifest
