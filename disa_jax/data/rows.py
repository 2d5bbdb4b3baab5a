"""Prompt files as rows, the checked fields of a row, and prompt records written back as veRL rows.

- `read_rows(path)`: the rows of a .jsonl / .json (list) / .parquet file (json/jsonl may be .gz),
  local or a URL (``gs://``, `disa_jax.paths`); a bad line or row is refused naming the file and
  line.
- The field checks every prompt format's loader uses (`disa_jax.tasks`): `text`,
  `optional_text`, `first_text`, `answer_text`, `answers` (one answer or a list of acceptable
  ones), `row_id`, `source_name`; each error names the file, the row, the field and its value.
- `save_prompts(records, path)`: `PromptRecord`s as veRL rows (.jsonl or .parquet), the format
  `disa_jax.tasks.prompts.load_prompts` reads back.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import math
import os
from typing import Any, Iterable, Mapping, Sequence

from disa_jax import paths
from disa_jax.data import parquet
from disa_jax.data.records import PromptRecord

__all__ = ["read_rows", "save_prompts", "short", "source_name", "row_id", "text", "optional_text",
           "first_text", "answer_text", "answers"]


def short(value: Any, limit: int = 80) -> str:
  """`repr(value)`, cut to `limit` characters (values are quoted in errors)."""
  text = repr(value)
  return text if len(text) <= limit else text[:limit - 3] + "..."


def _json_rows(path: str, name: str, f) -> list[Any]:
  """The rows of an open .jsonl / .json text stream (unvalidated)."""
  if name.endswith(".jsonl"):
    rows = []
    for lineno, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        row = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{lineno}: invalid JSON: {e}") from e
      if not isinstance(row, dict):
        raise ValueError(f"{path}:{lineno}: expected a JSON object per line, got "
                         f"{type(row).__name__} {short(row)}")
      rows.append(row)
    return rows
  try:
    data = json.load(f)
  except json.JSONDecodeError as e:
    raise ValueError(f"{path}: invalid JSON: {e}") from e
  if isinstance(data, dict):  # {id: row} maps
    data = list(data.values())
  if not isinstance(data, list):
    raise ValueError(f"{path}: expected a JSON list of objects, got {type(data).__name__}")
  for i, row in enumerate(data):
    if not isinstance(row, dict):
      raise ValueError(f"{path}: row {i}: expected a JSON object, got {type(row).__name__} "
                       f"{short(row)}")
  return data


def read_rows(path: str) -> list[dict[str, Any]]:
  """Rows of a .jsonl / .json (list) / .parquet file, optionally .gz-compressed (json/jsonl);
  local or a URL.

  Raises:
    ValueError: on an unknown extension, an unreadable file (bad JSON on a line, with its line
      number; not parquet; not gzip; not UTF-8), or a row that is not an object.
  """
  name = path[:-3] if path.endswith(".gz") else path
  if not name.endswith((".parquet", ".jsonl", ".json")):
    raise ValueError(f"{path}: unknown file type (expected .jsonl, .json, .parquet; json/jsonl "
                     "may be .gz)")
  if name.endswith(".parquet"):
    try:
      with paths.as_path(path).open("rb") as f:
        return parquet.read_rows(f)
    except parquet.ParquetError as e:
      raise ValueError(f"{path}: not a readable parquet file: {e}") from e
  try:
    with contextlib.ExitStack() as stack:
      raw = stack.enter_context(paths.as_path(path).open("rb"))
      if path.endswith(".gz"):
        raw = stack.enter_context(gzip.open(raw))
      return _json_rows(path, name, stack.enter_context(io.TextIOWrapper(raw, encoding="utf-8")))
  except UnicodeDecodeError as e:
    raise ValueError(f"{path}: not UTF-8 text: {e}") from e
  except gzip.BadGzipFile as e:
    raise ValueError(f"{path}: not a gzip file: {e}") from e


def source_name(path: str) -> str:
  """A file's default data source: its base name without the .gz / .jsonl / .json / .parquet."""
  base = os.path.basename(path)
  for ext in (".gz", ".jsonl", ".json", ".parquet"):
    if base.endswith(ext):
      base = base[:-len(ext)]
  return base


def row_id(row: Mapping[str, Any], i: int, keys: Iterable[str]) -> str:
  """The first of ``keys`` the row sets (not null, not empty), as text; else the row's index."""
  for k in keys:
    if row.get(k) not in (None, ""):
      return str(row[k])
  return str(i)


def text(value: Any, where: str) -> str:
  """A required text field: a non-empty str, never None nor the text 'None'.

  Args:
    value: the field's value.
    where: names the file, row and field in errors.

  Returns:
    `value`.

  Raises:
    ValueError: naming `where` and the value.
  """
  if value is None:
    raise ValueError(f"{where} is missing or null")
  if not isinstance(value, str):
    raise ValueError(f"{where} must be a string, got {type(value).__name__} {short(value)}")
  if not value.strip():
    raise ValueError(f"{where} is empty: {value!r}")
  if value.strip() == "None":
    raise ValueError(f"{where} is the string 'None' (a null written out as text upstream?)")
  return value


def optional_text(row: Mapping[str, Any], key: str, where: str) -> str | None:
  """`row[key]` when it is a non-empty string, None when absent, null or empty; else an error."""
  value = row.get(key)
  if value is None or (isinstance(value, str) and not value.strip()):
    return None
  return text(value, f"{where}: {key}")


def first_text(row: Mapping[str, Any], keys: Sequence[str], where: str) -> str:
  """The first of `keys` that is present and not null, as required text."""
  for k in keys:
    if row.get(k) is not None:
      return text(row[k], f"{where}: {k}")
  raise ValueError(f"{where}: {' or '.join(keys)} is missing or null (row keys "
                   f"{sorted(row)})")


def answer_text(value: Any, where: str) -> str:
  """One answer as text: a non-empty string or a finite number (never None / 'None' / NaN)."""
  if value is None:
    raise ValueError(f"{where} is missing or null")
  if isinstance(value, bool) or not isinstance(value, (str, int, float)):
    raise ValueError(f"{where} must be a string or a number, got {type(value).__name__} "
                     f"{short(value)}")
  if isinstance(value, float):
    if not math.isfinite(value):
      raise ValueError(f"{where} must be a finite number, got {value!r}")
    return repr(value)
  if isinstance(value, int):
    return str(value)
  return text(value, where).strip()


def answers(value: Any, where: str) -> str | list[str]:
  """An answer ground truth: one answer, or a non-empty list of acceptable answers."""
  if hasattr(value, "tolist"):  # numpy arrays from pandas-written parquet
    value = value.tolist()
  if isinstance(value, (list, tuple)):
    if not value:
      raise ValueError(f"{where} is an empty list")
    return [answer_text(v, f"{where}[{j}]") for j, v in enumerate(value)]
  return answer_text(value, where)


def save_prompts(records: Sequence[PromptRecord], path: str) -> None:
  """Writes records as veRL rows (`.jsonl` or `.parquet`).

  Raises:
    ValueError: on another extension.
  """
  rows = [r.to_verl_row() for r in records]
  if path.endswith(".parquet"):
    with paths.as_path(path).open("wb") as f:
      parquet.write_rows(rows, f)
  elif path.endswith(".jsonl"):
    with paths.as_path(path).open("w", encoding="utf-8") as f:
      for row in rows:
        f.write(json.dumps(row) + "\n")
  else:
    raise ValueError(f"save_prompts: path must end in .jsonl or .parquet, got {path!r}")
