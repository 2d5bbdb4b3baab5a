"""Prompt files of any registered format -> `PromptRecord`s: the one `load_prompts`.

`load_prompts(path, fmt='auto', *, data_source=None, limit=None)` reads a file with a registered
prompt format (`disa_jax.tasks.registry`): 'verl' (`disa_jax.tasks.verl`, the format every task's
sets are stored in), the math task's 'math', 'minerva', 'olympiadbench' (`disa_jax.tasks.math`) and
the code task's 'humanevalplus', 'rllm_code' (`disa_jax.tasks.code`), or a format a plugin
registers. ``fmt`` may be a benchmark's name (`benchmark_formats()`); 'auto' tries the formats'
``detect`` on the first row's keys. Prompts of non-veRL formats are a one-message chat list with
the task's template applied. `records_from_rows` does the same for rows already read (a Hugging
Face dataset's). Files are read by `disa_jax.data.rows.read_rows` (a path may be a URL) and written
by `disa_jax.data.rows.save_prompts`.
"""
from __future__ import annotations

import os
from typing import Any, Sequence

from disa_jax.data import rows as rows_lib
from disa_jax.data.records import PromptRecord
from disa_jax.tasks import registry

__all__ = ["formats", "benchmark_formats", "detect_format", "load_prompts", "records_from_rows"]


def formats() -> tuple[str, ...]:
  """The registered prompt formats' names (`registry.format_names`)."""
  return registry.format_names()


def benchmark_formats() -> dict[str, str]:
  """Benchmark name -> its prompt format (`registry.benchmark_formats`)."""
  return registry.benchmark_formats()


def detect_format(path: str, rows: Sequence[dict[str, Any]]) -> str:
  """Guesses the format of `rows` read from `path` (the formats' ``detect``, by ``detect_rank``).

  Raises:
    ValueError: when no format fits.
  """
  if not rows:
    raise ValueError(f"{path}: no rows")
  keys = frozenset(k for k, v in rows[0].items() if v is not None)  # parquet fills absent columns with null
  base = os.path.basename(path).lower()
  for fmt in sorted((registry.prompt_format(n) for n in formats()), key=lambda f: f.detect_rank):
    if fmt.detect(keys, base):
      return fmt.name
  raise ValueError(f"{path}: cannot detect the format from keys {sorted(keys)}; pass fmt= one of "
                   f"{formats()}")


def load_prompts(path: str, fmt: str = "auto", *, data_source: str | None = None,
                 limit: int | None = None) -> list[PromptRecord]:
  """Loads a prompt file as `PromptRecord`s (formats: see module docstring).

  Args:
    path: .jsonl / .json / .parquet (json/jsonl may be .gz).
    fmt: 'auto' or one of `formats()`; a benchmark name of `benchmark_formats()` is accepted too.
    data_source: the records' data source (default: the file's base name; veRL rows keep theirs).
    limit: keep only the first `limit` rows (>= 1; None: all).

  Returns:
    The records, in file order (never empty).

  Raises:
    ValueError: on an unknown format, an empty file, or a malformed row (the message names the
      file, the row (0-based), the field and its value).
  """
  benchmarks = benchmark_formats()
  fmt = benchmarks.get(fmt, fmt)
  if fmt != "auto" and fmt not in formats():
    raise ValueError(f"fmt must be 'auto', one of {formats()} or a benchmark of "
                     f"{sorted(benchmarks)}, got {fmt!r}")
  if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
    raise ValueError(f"limit must be an int >= 1 or None, got {limit!r}")
  rows = rows_lib.read_rows(path)
  if not rows:
    raise ValueError(f"{path}: the file has no rows")
  if limit is not None:
    rows = rows[:limit]
  return records_from_rows(rows, fmt, where=path,
                           data_source=data_source or rows_lib.source_name(path))


def records_from_rows(rows: Sequence[dict[str, Any]], fmt: str, *, where: str,
                      data_source: str) -> list[PromptRecord]:
  """`PromptRecord`s of rows already read (a file's, or a Hugging Face dataset's).

  Args:
    rows: the rows (non-empty).
    fmt: 'auto' or one of `formats()` (benchmark names already mapped).
    where: what the rows come from, for messages (a path, a dataset name).
    data_source: the records' data source (veRL rows keep theirs).

  Raises:
    ValueError: on a malformed row (naming ``where``, the row, the field and its value) or a
      duplicate prompt id.
  """
  if fmt == "auto":
    fmt = detect_format(where, rows)
  record = registry.prompt_format(fmt).record
  records = [record(row, i, data_source, f"{where}: row {i}") for i, row in enumerate(rows)]
  seen = set()
  for r in records:
    if r.prompt_id in seen:
      raise ValueError(f"{where}: duplicate prompt_id {r.prompt_id!r}")
    seen.add(r.prompt_id)
  return records
