"""The one ConfigDict -> typed-config conversion used by every command.

Every entry point reads an `ml_collections` config file and converts its ConfigDict once, with
`from_mapping`, into a tree of frozen dataclasses: the Stage 1 / 2 / 3 / evaluation / SFT workflow
configs, the main job's config and the Stage 3 `TrainConfig`. The conversion refuses unknown and
missing fields, converts lists to tuples, coerces ints to floats where a float is declared, refuses
NaN and +-inf in every float of every stage's config (`refuse_nonfinite`: typed fields, and the
values of open sections such as ``engine.vllm_kwargs`` / ``jax_kwargs`` and a run's
``overrides``; no field gives infinity a meaning, and a range check written as a comparison lets NaN
through: ``lr=inf`` and ``weight_decay=nan`` were accepted), and names the dotted field in every
error; each dataclass then validates its own values in ``__post_init__``, so
nothing downstream re-checks them.

A field whose type defines ``from_config(value, where)`` (a classmethod) is built by it: this is
how a polymorphic section such as the Stage 3 objective (`disa_jax.rl.objectives`) picks its class
from a ``name`` entry. `to_dict` is the inverse (JSON-ready), using ``to_config()`` where a value
defines it and leaving out a field declared with `disa_jax.codec.field`'s ``omit`` while it holds
that value (a field added since, recorded only where set, so that the identity files of outputs
written before it existed still match).

`check_attention_chunk` is the one check of the ``attention_chunk`` field that the workflow
sections building a `Transformer` for long sequences carry (Stage 3 ``model``, the Stage 1 / 2
scorer, the SFT section, ``exact_target``); `Transformer` applies it to its argument too, and
`check_attention_impl` / `check_remat_policy` to the ``attention_impl`` / ``remat_policy`` fields
next to it.
"""
from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any, Mapping, TypeVar

from disa_jax import codec

T = TypeVar("T")

__all__ = ["ATTENTION_IMPLS", "REMAT_POLICIES", "check_attention_chunk", "check_attention_impl",
           "check_remat_policy", "from_mapping", "qualify", "to_dict"]

# `Transformer` attention implementations (`disa_jax.models.attention_dispatch`): 'auto' = 'xla' on
# a CPU, 'cudnn' on a GPU, 'splash' on a TPU (each falling back to 'xla' for what it cannot run).
ATTENTION_IMPLS = ("auto", "dense", "xla", "pallas", "cudnn", "splash")
# What a rematerialised decoder layer keeps for the backward pass (`Transformer.remat_policy`).
REMAT_POLICIES = ("full", "save_attn", "save_qkv_attn", "save_qkv_attn_mlp")


def check_count(value: Any, field: str, zero: str = "") -> None:
  """Refuses a count that is not an int >= 0 (a bool is not one), naming ``field``, what 0 means
  (``zero``, if anything) and the value."""
  if isinstance(value, bool) or not isinstance(value, int) or value < 0:
    raise ValueError(f"{field} must be an int >= 0{f' ({zero})' if zero else ''}, got {value!r}")


def check_attention_chunk(value: Any, field: str = "attention_chunk") -> None:
  """Refuses an attention query-block size that is not an int >= 0, naming ``field`` and the value.

  0 = no chunking (the implementation's own query blocks: block-sparse for 'xla', causal blocks of
  the `[T, T]` mask for 'dense'); c > 0 = queries in blocks of c tokens whose probabilities the
  backward pass recomputes (`disa_jax.models.attention_xla`), any row length.
  """
  check_count(value, field, "0 = no chunking, c > 0 = query blocks of c tokens")


def check_attention_impl(value: Any, field: str = "attention_impl") -> None:
  """Refuses an attention implementation not in `ATTENTION_IMPLS`, naming ``field`` and value."""
  if value not in ATTENTION_IMPLS:
    raise ValueError(f"{field} must be one of {ATTENTION_IMPLS}, got {value!r}")


def check_remat_policy(value: Any, field: str = "remat_policy") -> None:
  """Refuses a remat policy not in `REMAT_POLICIES`, naming ``field`` and the value."""
  if value not in REMAT_POLICIES:
    raise ValueError(f"{field} must be one of {REMAT_POLICIES}, got {value!r}")


def _to_plain(value: Any) -> Any:
  if hasattr(value, "to_dict") and not dataclasses.is_dataclass(value):  # ConfigDict
    return value.to_dict()
  return value


def _optional_inner(hint: Any) -> Any | None:
  """``X | None`` -> X; anything else -> None."""
  if typing.get_origin(hint) in (typing.Union, types.UnionType):
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if len(args) == 1 and type(None) in typing.get_args(hint):
      return args[0]
  return None


def refuse_nonfinite(value: Any, key: str) -> None:
  """Refuses NaN and +-inf anywhere in a plain value (a float, or one inside lists, tuples and
  mappings: the open sections such as ``engine.vllm_kwargs``), naming the dotted field."""
  if isinstance(value, float) and not math.isfinite(value):
    raise ValueError(f"{key} must be a finite number, got {value!r}")
  if isinstance(value, (list, tuple)):
    for i, v in enumerate(value):
      refuse_nonfinite(v, f"{key}[{i}]")
  elif isinstance(value, Mapping):
    for k, v in value.items():
      refuse_nonfinite(v, f"{key}.{k}")


def _convert(hint: Any, value: Any, key: str) -> Any:
  """Converts one field value to its declared type (see module docstring)."""
  value = _to_plain(value)
  if not dataclasses.is_dataclass(value):
    refuse_nonfinite(value, key)  # every float, typed or in an open section (one check for all)
  inner = _optional_inner(hint)
  if inner is not None:
    return None if value is None else _convert(inner, value, key)
  if isinstance(hint, type) and hasattr(hint, "from_config"):
    return value if isinstance(value, hint) else hint.from_config(value, key)
  if dataclasses.is_dataclass(hint):
    return value if isinstance(value, hint) else from_mapping(hint, value, key)
  origin = typing.get_origin(hint)
  if origin is tuple or hint is tuple:
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
      raise ValueError(f"{key} must be a list or tuple, got {value!r}")
    args = typing.get_args(hint)
    item = args[0] if args and (len(args) == 1 or args[-1] is Ellipsis) else None
    return tuple(_convert(item, v, f"{key}[{i}]") if item is not None else v
                 for i, v in enumerate(value))
  if hint is dict or origin is dict:
    if not isinstance(value, Mapping):
      raise ValueError(f"{key} must be a mapping, got {value!r}")
    args = typing.get_args(hint)
    item = args[1] if len(args) == 2 else None
    if item is not None and (dataclasses.is_dataclass(item) or hasattr(item, "from_config")):
      return {k: _convert(item, v, f"{key}.{k}") for k, v in value.items()}
    return {k: _to_plain(v) for k, v in value.items()}
  if hint in (int, float, str, bool):
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
      value = float(value)
    if not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
      raise ValueError(f"{key} must be {hint.__name__}, got {value!r}")
  return value


def from_mapping(cls: type[T], data: Mapping[str, Any] | Any, where: str = "config") -> T:
  """Builds the frozen dataclass ``cls`` from ``data``, recursing into dataclass-typed fields.

  Args:
    cls: a dataclass type (fields typed as dataclasses, ``tuple[...]``, ``dict``, ``X | None``,
      int / float / str / bool, or a type with a ``from_config`` classmethod).
    data: a mapping or an `ml_collections.ConfigDict`.
    where: the dotted name of ``data`` used in error messages.

  Returns:
    The dataclass instance (its ``__post_init__`` validation runs as usual).

  Raises:
    ValueError: on an unknown field, a missing field without default, a value of the wrong kind
      or range, or a float field set to NaN or +-inf; the message names the dotted field.
  """
  data = _to_plain(data)
  if not isinstance(data, Mapping):
    raise ValueError(f"{where} must be a mapping of fields, got {type(data).__name__}: {data!r}")
  hints = typing.get_type_hints(cls)
  fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
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
    kwargs[name] = _convert(hints[name], data[name], key)
  try:
    return cls(**kwargs)
  except (TypeError, ValueError) as e:
    raise ValueError(qualify(str(e), where)) from None


def qualify(msg: str, where: str) -> str:
  """Prefixes a validation message with the dotted path ``where`` of the section that raised it
  (`from_mapping`, and a config derived from a converted one with ``dataclasses.replace``)."""
  if msg.startswith(where):
    return msg
  parent, _, last = where.rpartition(".")
  if parent and msg.startswith(last + "."):  # 'a.b.replay' + 'replay.fraction ...'
    return f"{parent}.{msg}"
  return f"{where}: {msg}"


def to_dict(obj: Any) -> Any:
  """A JSON-ready form of a dataclass tree (tuples become lists; ``to_config()`` where defined;
  a field left out while it holds its `codec.field` ``omit`` value)."""
  if hasattr(obj, "to_config"):
    return to_dict(obj.to_config())
  if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
    return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)
            if f.init and not codec.omitted(f, getattr(obj, f.name))}
  if isinstance(obj, (tuple, list)):
    return [to_dict(x) for x in obj]
  if isinstance(obj, Mapping):
    return {k: to_dict(v) for k, v in obj.items()}
  return obj
