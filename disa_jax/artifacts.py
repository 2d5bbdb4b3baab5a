"""What every stage artifact shares: reading its JSON file with errors that name the file and the field.

A stage artifact (`disa_jax.eval.exact.ExactTarget`, `disa_jax.workflows.stage3.Stage3Run`, ...) is
a frozen dataclass that owns its directory or file, is returned by its workflow and loads itself
from disk (``<Artifact>.load(path)``). The files keep the JSON format the workflows wrote before
the artifacts existed, so older work directories load too. A missing file, a file that is not JSON,
or a missing / mistyped field raises `ArtifactError` naming the file and the field.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from disa_jax import paths


class ArtifactError(ValueError):
  """An artifact's file is missing, unreadable, or lacks a field (the message names which)."""


def read_json(path: str | Path, what: str) -> dict[str, Any]:
  """The JSON object in ``path`` (``what``: the artifact, for the message)."""
  path = paths.as_path(path)
  if not path.is_file():
    raise ArtifactError(f"{what}: {path} does not exist")
  try:
    obj = json.loads(path.read_text())
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
    raise ArtifactError(f"{what}: {path} is not readable JSON ({e})") from None
  if not isinstance(obj, dict):
    raise ArtifactError(f"{what}: {path} holds a JSON {type(obj).__name__}, not an object")
  return obj


def read_jsonl(path: str | Path, what: str) -> list[dict[str, Any]]:
  """The JSON objects of ``path``, one a line (blank lines skipped)."""
  path = paths.as_path(path)
  if not path.is_file():
    raise ArtifactError(f"{what}: {path} does not exist")
  rows = []
  for i, line in enumerate(path.read_text().splitlines()):
    if not line.strip():
      continue
    try:
      rows.append(json.loads(line))
    except json.JSONDecodeError as e:
      raise ArtifactError(f"{what}: {path} line {i + 1} is not JSON ({e})") from None
  return rows


def field(obj: Mapping[str, Any], name: str, path: str | Path, kind: type | tuple[type, ...]
          ) -> Any:
  """``obj[name]``, checked to be a ``kind`` (an int is accepted where a float is asked)."""
  if name not in obj:
    raise ArtifactError(f"{path}: field {name!r} is missing")
  value = obj[name]
  kinds = kind if isinstance(kind, tuple) else (kind,)
  if float in kinds:
    kinds += (int,)
  if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
    raise ArtifactError(f"{path}: field {name!r} must be {' or '.join(k.__name__ for k in kinds)}, "
                        f"got {type(value).__name__}")
  return value


def str_tuple(obj: Mapping[str, Any], name: str, path: str | Path) -> tuple[str, ...]:
  values = field(obj, name, path, list)
  if not all(isinstance(v, str) for v in values):
    raise ArtifactError(f"{path}: field {name!r} must be a list of strings")
  return tuple(values)


def write_json(path: str | Path, obj: Any) -> None:
  """``obj`` as indented JSON, written atomically (a temporary file renamed over ``path``)."""
  path = paths.as_path(path)
  tmp = path.with_suffix(path.suffix + ".tmp")
  tmp.write_text(json.dumps(obj, indent=1, default=float))
  paths.replace(tmp, path)


def fields_equal(a: Any, b: Any) -> bool:
  """Dataclass equality that compares array fields by value (`numpy.array_equal`)."""
  if type(a) is not type(b):
    return False
  for f in dataclasses.fields(a):
    x, y = getattr(a, f.name), getattr(b, f.name)
    if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
      if not np.array_equal(np.asarray(x), np.asarray(y), equal_nan=True):
        return False
    elif not _equal(x, y):
      return False
  return True


def _equal(x: Any, y: Any) -> bool:
  if isinstance(x, Mapping) and isinstance(y, Mapping):
    return x.keys() == y.keys() and all(_equal(x[k], y[k]) for k in x)
  if isinstance(x, Sequence) and isinstance(y, Sequence) and not isinstance(x, str):
    return len(x) == len(y) and all(_equal(u, v) for u, v in zip(x, y))
  if dataclasses.is_dataclass(x) and dataclasses.is_dataclass(y):
    return fields_equal(x, y)
  if isinstance(x, float) and isinstance(y, float) and np.isnan(x) and np.isnan(y):
    return True
  return x == y
