"""ConfigDict (or plain dict) -> frozen dataclass, with errors that name the offending field.

The workflow commands read `ml_collections` config files; each converts its ConfigDict once into a
frozen dataclass tree with `from_mapping`, which refuses unknown and missing fields and converts
lists to tuples, so the rest of the code takes explicit, typed arguments.
"""
from __future__ import annotations

import dataclasses
import typing
from typing import Any, Mapping, TypeVar

T = TypeVar("T")


def _to_plain(value: Any) -> Any:
  if hasattr(value, "to_dict"):  # ml_collections.ConfigDict / FrozenConfigDict
    return value.to_dict()
  return value


def from_mapping(cls: type[T], data: Mapping[str, Any] | Any, where: str = "config") -> T:
  """Builds the frozen dataclass ``cls`` from ``data``, recursing into dataclass-typed fields.

  Args:
    cls: a dataclass type; fields typed as another dataclass are built recursively, fields typed
      ``tuple[...]`` get tuples, fields typed ``dict`` get plain dicts.
    data: a mapping (or a ConfigDict).
    where: the dotted name of ``data`` used in error messages.

  Returns:
    The dataclass instance (its ``__post_init__`` validation runs as usual).

  Raises:
    ValueError: on an unknown field, a missing field without default, or a value of the wrong kind;
      the message names the dotted field.
  """
  data = _to_plain(data)
  if not isinstance(data, Mapping):
    raise ValueError(f"{where} must be a mapping of fields, got {type(data).__name__}")
  hints = typing.get_type_hints(cls)
  fields = {f.name: f for f in dataclasses.fields(cls)}
  unknown = sorted(set(data) - set(fields))
  if unknown:
    raise ValueError(f"{where}: unknown field(s) {unknown}; known fields: {sorted(fields)}")
  kwargs = {}
  for name, f in fields.items():
    key = f"{where}.{name}"
    if name not in data:
      if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
        raise ValueError(f"{key} is required")
      continue
    value, hint = _to_plain(data[name]), hints[name]
    if dataclasses.is_dataclass(hint):
      value = from_mapping(hint, value, key)
    elif typing.get_origin(hint) is tuple:
      if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise ValueError(f"{key} must be a list or tuple, got {value!r}")
      value = tuple(value)
    elif hint is dict or typing.get_origin(hint) is dict:
      if not isinstance(value, Mapping):
        raise ValueError(f"{key} must be a mapping, got {value!r}")
      value = dict(value)
    elif hint in (int, float, str, bool):
      if hint is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
      if not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
        raise ValueError(f"{key} must be {hint.__name__}, got {value!r}")
    kwargs[name] = value
  try:
    return cls(**kwargs)
  except (TypeError, ValueError) as e:
    raise ValueError(f"{where}: {e}") from None


def to_dict(obj: Any) -> dict[str, Any]:
  """A JSON-ready dict of a dataclass tree (tuples become lists)."""
  def plain(v):
    if isinstance(v, tuple):
      return [plain(x) for x in v]
    if isinstance(v, dict):
      return {k: plain(x) for k, x in v.items()}
    return v
  return plain(dataclasses.asdict(obj))
