"""The one codec of every artifact: a dataclass <-> its JSON object, driven by the fields' types.

`encode` writes a dataclass as a JSON-ready dict, its fields in declaration order (nested
dataclasses as objects, tuples as lists, paths as strings, arrays as lists); `decode` reads it
back, checking each value against the field's type hint (int, float, str, bool, ``X | None``,
``tuple[...]``, mappings, nested dataclasses, `pathlib.Path`, `numpy.ndarray`) and raising
`artifacts.ArtifactError` that names the file, the dotted field and the bad value. A key missing
from the file takes the field's default (files written before a field existed load); a mapping's
values are checked only when they are dataclasses.

A field whose layout is irregular declares it with `field` (stored in ``dataclasses.field``'s
metadata): another JSON key, a dotted key (``'nonfinite_labels.count'``: two fields in one nested
object), not stored, left out when it holds a given value, merged into its parent (``inline``),
or stored row-wise with other fields (``rows``: ``[{"prompt_id": .., "correct": ..}, ..]``). A
class may add derived keys after its fields (``json_extra(self) -> dict``; ignored when read) and
refuse unknown keys (``JSON_STRICT = True``). `save` / `load` write and read one file.

A class may be the base of a tagged union: ``JSON_TAG`` names the attribute (and the key, written
first) that holds each subclass's tag, ``JSON_VARIANTS`` maps tags to subclasses; a field typed as
the base is decoded as the subclass its tag names (the Stage 3 objectives, `disa_jax.rl.objectives`).

The same walk reads configs: `decode` with ``path`` None reads a config section (a dict or an
`ml_collections.ConfigDict`, `disa_jax.config.from_mapping`): every section refuses unknown keys,
a float field refuses NaN and +-inf, a type with ``from_config(value, where)`` builds its field,
and errors are ``ValueError``s naming the dotted field (``config.train.optim.lr must be ...``).
"""
from __future__ import annotations

import dataclasses
import math
import os
import types
import typing
from pathlib import Path
from typing import Any, Callable, Mapping, TypeVar

import numpy as np

from disa_jax import artifacts, paths
from disa_jax.artifacts import ArtifactError

T = TypeVar("T")
META = "codec"
_NOT_SET = object()


@dataclasses.dataclass(frozen=True)
class Spec:
  """How one field is stored (see the module docstring); `field` builds it."""
  key: str | None = None  # the JSON key (dotted: inside a nested object); None: the field's name
  stored: bool = True  # False: not in the JSON (decode takes it from its caller or the default)
  omit: Any = _NOT_SET  # left out when the value is this (and read as this when missing)
  inline: bool = False  # a dataclass or mapping whose keys are merged into the parent object
  keys: tuple[str, ...] | None = None  # an inline mapping's keys (read in this order)
  rows: str | None = None  # stored row-wise under this key with the fields of the same ``rows``
  dtype: Any = None  # an array's dtype (float64 when None; written through it when given)
  size_of: str | None = None  # an array as long as this (earlier) field
  missing: Callable[[dict[str, Any]], Any] | None = None  # value of a missing key (fields so far)
  required: bool = False  # a missing key is an error even though the field has a default


def field(*, default: Any = dataclasses.MISSING, default_factory: Any = dataclasses.MISSING,
          **spec: Any) -> Any:
  """``dataclasses.field`` with its storage declared (`Spec`'s arguments)."""
  return dataclasses.field(default=default, default_factory=default_factory,
                           metadata={META: Spec(**spec)})


def _spec(f: dataclasses.Field) -> Spec:
  return f.metadata.get(META) or Spec()


def _key(f: dataclasses.Field) -> str:
  return _spec(f).key or f.name


def _join(where: str, key: str) -> str:
  return f"{where}.{key}" if where else key


def _stored(cls: type) -> list[dataclasses.Field]:
  return [f for f in dataclasses.fields(cls) if _spec(f).stored]


def encode(obj: Any, omit: tuple[str, ...] = ()) -> Any:
  """The JSON-ready form of ``obj`` (a dataclass: its stored fields but the keys in ``omit``)."""
  if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
    tag = getattr(obj, "JSON_TAG", None)
    out: dict[str, Any] = {tag: getattr(obj, tag)} if tag else {}
    for f in _stored(type(obj)):
      spec, value = _spec(f), getattr(obj, f.name)
      if _key(f) in omit or omitted(f, value):
        continue
      if spec.rows is not None:
        _put_row(out, spec, _key(f), value)
      elif spec.inline:
        out.update(encode(value))
      else:
        _put(out, _key(f), encode(_typed(value, spec)))
    return out | (encode(obj.json_extra()) if hasattr(obj, "json_extra") else {})
  if isinstance(obj, np.ndarray):
    return obj.tolist()
  if isinstance(obj, (os.PathLike, paths.RemotePath)):
    return str(obj)
  if isinstance(obj, (tuple, list)):
    return [encode(v) for v in obj]
  if isinstance(obj, Mapping):
    return {k: encode(v) for k, v in obj.items()}
  return obj


def omitted(f: dataclasses.Field, value: Any) -> bool:
  """Whether field ``f`` holding ``value`` is left out of its JSON (its ``omit`` value: a field
  added since, recorded only where set, so that files written before it existed still match)."""
  spec = _spec(f)
  return spec.omit is not _NOT_SET and (value is spec.omit or (type(value) is type(spec.omit)
                                                                and value == spec.omit))


def _put(out: dict[str, Any], key: str, value: Any) -> None:
  *parents, last = key.split(".")
  for p in parents:
    out = out.setdefault(p, {})
  out[last] = value


def _typed(value: Any, spec: Spec) -> Any:
  return value.astype(spec.dtype) if spec.dtype and isinstance(value, np.ndarray) else value


def _put_row(out: dict[str, Any], spec: Spec, key: str, column: Any) -> None:
  values = encode(_typed(column, spec))
  rows = out.setdefault(spec.rows, [{} for _ in values])
  for row, v in zip(rows, values):
    row[key] = v


def decode(cls: type[T], obj: Any, path: str | Path | None, where: str = "", /,
           **given: Any) -> T:
  """The ``cls`` stored in ``obj`` (read from ``path``; ``where``: its dotted field there, '' for
  the whole file; ``path`` None: a config section, see the module docstring); ``given`` fields are
  not read but taken as they are."""
  obj = _plain(obj)
  if not isinstance(obj, Mapping):
    raise (ValueError(f"{where} must be a mapping of fields, got {type(obj).__name__}: {obj!r}")
           if path is None else
           ArtifactError(f"{path}: field {where!r} must be an object, got {_got(obj)}" if where
                         else f"{path} holds a JSON {type(obj).__name__}, not an object"))
  hints, kwargs = typing.get_type_hints(cls), dict(given)
  if path is None:  # (a config's unknown keys first: before any value is read)
    _check_known(cls, obj, path, where)
  for f in _stored(cls):
    spec, name = _spec(f), _join(where, _key(f))
    if f.name in given or not f.init:
      continue
    if spec.rows is not None:
      kwargs[f.name] = _column(hints[f.name], obj, path, where, spec, _key(f))
    elif spec.inline and dataclasses.is_dataclass(_required(hints[f.name])):
      kwargs[f.name] = decode(_required(hints[f.name]), obj, path, where)
    elif spec.inline:
      item = (typing.get_args(hints[f.name]) or (Any, Any))[1]
      kwargs[f.name] = {k: _value(item, _get(obj, k, path, where), path, _join(where, k), spec)
                        for k in spec.keys}
    elif _has(obj, _key(f)):
      value = _value(hints[f.name], _get(obj, _key(f), path, where), path, name, spec)
      kwargs[f.name] = value
      if spec.size_of is not None and len(value) != len(kwargs[spec.size_of]):
        raise ArtifactError(f"{path}: field {name!r} must hold {len(kwargs[spec.size_of])} "
                            f"numbers, got shape {value.shape}")
    elif spec.missing is not None:
      kwargs[f.name] = spec.missing(kwargs)
    elif spec.omit is not _NOT_SET:
      kwargs[f.name] = spec.omit
    elif spec.required or (f.default is dataclasses.MISSING
                           and f.default_factory is dataclasses.MISSING):
      if path is None:
        raise ValueError(f"{name} is required")
      _get(obj, _key(f), path, where)  # raises, naming the missing (or mistyped) part
  if path is not None:
    _check_known(cls, obj, path, where)
  try:
    return cls(**kwargs)
  except (TypeError, ValueError) as e:
    if path is None:
      raise ValueError(qualify(str(e), where)) from None
    raise ArtifactError(f"{path}: field {where!r} is malformed ({e})" if where
                        else f"{path}: {e}") from None


def read_config(cls: type[T], data: Any, where: str = "config") -> T:
  """The config section ``data`` (a mapping or ConfigDict; ``where``: its dotted name) as a
  ``cls``: a dataclass, or a tagged union's base (the subclass its tag names)."""
  if "JSON_VARIANTS" in vars(cls):
    return _variant(cls, _plain(data), None, where)
  return decode(cls, data, None, where)


def qualify(msg: str, where: str) -> str:
  """Prefixes a validation message with the dotted path ``where`` of the config section that
  raised it (`decode` of a config, and a config derived from a converted one with
  ``dataclasses.replace``)."""
  if msg.startswith(where):
    return msg
  parent, _, last = where.rpartition(".")
  if parent and msg.startswith(last + "."):  # 'a.b.replay' + 'replay.fraction ...'
    return f"{parent}.{msg}"
  return f"{where}: {msg}"


def _plain(value: Any) -> Any:
  """An `ml_collections.ConfigDict` as a dict; any other value as it is."""
  if hasattr(value, "to_dict") and not dataclasses.is_dataclass(value):
    return value.to_dict()
  return value


def _required(hint: Any) -> Any:
  """``X | None`` -> X; any other hint as it is."""
  args = [a for a in typing.get_args(hint) if a is not type(None)]
  return args[0] if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 1 \
      else hint


def _check_known(cls: type, obj: Mapping[str, Any], path: str | Path | None, where: str) -> None:
  known = {_key(f).split(".")[0] for f in _stored(cls)}
  unknown = sorted(set(obj) - known)
  if unknown and path is None:
    raise ValueError(f"{where}: unknown field(s) {unknown}; known fields: {sorted(known)}")
  if unknown and getattr(cls, "JSON_STRICT", False):
    raise ArtifactError(f"{path}: unknown fields {unknown} in "
                        f"{repr(where) if where else cls.__name__}")


def _has(obj: Any, key: str) -> bool:
  if isinstance(obj, Mapping) and key in obj:  # (a key holding a dot, read as it is)
    return True
  for part in key.split("."):
    if not isinstance(obj, Mapping) or part not in obj:
      return False
    obj = obj[part]
  return True


def _get(obj: Mapping[str, Any], key: str, path: str | Path, where: str) -> Any:
  """``obj[key]`` (a dotted key: through nested objects, unless ``obj`` holds it as it is), or the
  error naming the missing one."""
  if isinstance(obj, Mapping) and key in obj:
    return obj[key]
  done = where
  for part in key.split("."):
    if not isinstance(obj, Mapping):
      raise ArtifactError(f"{path}: field {done!r} must be an object, got {_got(obj)}")
    done = _join(done, part)
    if part not in obj:
      raise ArtifactError(f"{path}: field {done!r} is missing")
    obj = obj[part]
  return obj


def _column(hint: Any, obj: Mapping[str, Any], path: str | Path, where: str, spec: Spec,
            key: str) -> Any:
  """One field of the rows stored under ``spec.rows``."""
  rows = _value(list, _get(obj, spec.rows, path, where), path, _join(where, spec.rows), spec)
  values = [_get(row, key, path, _join(where, f"{spec.rows}[{i}]")) for i, row in enumerate(rows)]
  return _value(hint, values, path, _join(where, f"{spec.rows}[].{key}"), spec)


def _got(value: Any, path: str | Path | None = "") -> str:
  """A bad value as an error names it: its repr in a config, its type and (cut) repr in a file."""
  text = repr(value)
  if path is None:
    return text
  return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


def _fail(path: str | Path | None, name: str, msg: str) -> Exception:
  """The error of field ``name`` (``msg``: what is wrong): in a config or in the file ``path``."""
  return ValueError(f"{name} {msg}") if path is None else ArtifactError(
      f"{path}: field {name!r} {msg}")


def refuse_nonfinite(value: Any, key: str) -> None:
  """Refuses NaN and +-inf anywhere in a plain config value (a float, or one inside lists, tuples
  and mappings: the open sections such as ``engine.vllm_kwargs``), naming the dotted field."""
  if isinstance(value, float) and not math.isfinite(value):
    raise ValueError(f"{key} must be a finite number, got {value!r}")
  if isinstance(value, (list, tuple)):
    for i, v in enumerate(value):
      refuse_nonfinite(v, f"{key}[{i}]")
  elif isinstance(value, Mapping):
    for k, v in value.items():
      refuse_nonfinite(v, f"{key}.{k}")


def _value(hint: Any, value: Any, path: str | Path | None, name: str, spec: Spec = Spec()) -> Any:
  """``value`` checked against (and converted to) the type ``hint`` of field ``name``; in a config
  (``path`` None) every float in it, typed or in an open section, must be finite."""
  value = _plain(value)
  if path is None and not dataclasses.is_dataclass(value):
    refuse_nonfinite(value, name)
  origin, args = typing.get_origin(hint), typing.get_args(hint)
  if origin in (typing.Union, types.UnionType):
    if value is None and type(None) in args:
      return None
    inner = [a for a in args if a is not type(None)]
    return _value(inner[0] if len(inner) == 1 else Any, value, path, name, spec)
  if hint is not Any and isinstance(hint, type) and isinstance(value, hint) and (
      dataclasses.is_dataclass(hint) or hasattr(hint, "from_config")):
    return value
  if hint is not Any and isinstance(hint, type) and "JSON_VARIANTS" in vars(hint):  # (the base)
    return _variant(hint, value, path, name)
  if path is None and hasattr(hint, "from_config"):
    return hint.from_config(value, name)
  if dataclasses.is_dataclass(hint):
    return decode(hint, value, path, name)
  if hint is np.ndarray:
    try:
      return np.asarray(_value(list, value, path, name), spec.dtype or np.float64)
    except (TypeError, ValueError):
      raise ArtifactError(f"{path}: field {name!r} must be a list of numbers") from None
  base = origin or hint
  if base in (tuple, list):
    _check(value, list, path, name)
    if base is tuple and args and args[-1] is not Ellipsis:
      if len(value) != len(args):
        raise _fail(path, name, f"must hold {len(args)} values, got {_got(value, path)}")
      return tuple(_value(a, v, path, f"{name}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
    item = args[0] if args else Any
    items = [_value(item, v, path, f"{name}[{i}]") for i, v in enumerate(value)]
    return tuple(items) if base is tuple else items
  if base in (dict, Mapping, typing.Mapping) or (isinstance(base, type)
                                                  and issubclass(base, Mapping)):
    _check(value, dict, path, name)
    item = args[1] if len(args) == 2 else Any
    if (dataclasses.is_dataclass(item) or (path is None and hasattr(item, "from_config"))
        or _holds_records(item)):
      return {k: _value(item, v, path, f"{name}.{k}") for k, v in value.items()}
    return {k: _plain(v) for k, v in value.items()} if path is None else value
  if hint is Path:
    return paths.as_path(_check(value, str, path, name))
  if hint in (int, float, str, bool):
    value = _check(value, hint, path, name)
    return float(value) if hint is float else value
  return value


def _holds_records(hint: Any) -> bool:
  """``hint`` is a mapping, tuple or ``X | None`` type of dataclasses, at any depth
  (``Mapping[str, Mapping[str, Cell | None]]``: a mapping's values read as such,
  `pipeline.endpoints.EndpointsSection.cells`)."""
  origin, args = typing.get_origin(hint), typing.get_args(hint)
  return ((origin in (typing.Union, types.UnionType)
           or (isinstance(origin, type) and issubclass(origin, (Mapping, tuple))))
          and any(dataclasses.is_dataclass(a) or _holds_records(a) for a in args))


def _variant(hint: Any, value: Any, path: str | Path | None, name: str) -> Any:
  """The subclass of the tagged union ``hint`` that ``value``'s tag names, decoded."""
  tag, variants = hint.JSON_TAG, hint.JSON_VARIANTS
  if isinstance(value, hint):
    return value
  if not isinstance(value, Mapping) or tag not in value:
    raise _fail(path, name, f"must be a mapping with a {tag!r} in {tuple(sorted(variants))}, "
                f"got {_got(value, path)}")
  if value[tag] not in variants:
    raise _fail(path, f"{name}.{tag}", f"must be one of {tuple(sorted(variants))}, got "
                f"{_got(value[tag], path)}")
  return decode(variants[value[tag]], {k: v for k, v in value.items() if k != tag}, path, name)


# What a value of a kind must be, as a config's errors say it (a file's: the kind's name).
_CONFIG_KINDS = {list: ("a list or tuple", (list, tuple)), dict: ("a mapping", Mapping)}


def _check(value: Any, kind: type, path: str | Path | None, name: str) -> Any:
  """``value`` if it is a ``kind`` (an int is a float; a bool is not an int; in a config, a tuple
  is a list and any mapping a dict), else the error."""
  what, kinds = kind.__name__, (int, float) if kind is float else (kind,)
  if path is None and kind in _CONFIG_KINDS:
    what, kinds = _CONFIG_KINDS[kind]
  if not isinstance(value, kinds) or (isinstance(value, bool) and kind is not bool):
    raise _fail(path, name, f"must be {what}, got {_got(value, path)}")
  return value


def save(obj: Any, path: str | Path) -> None:
  """``obj`` encoded into the JSON file ``path`` (`artifacts.write_json`: atomic, indented)."""
  artifacts.write_json(path, encode(obj))


def load(cls: type[T], path: str | Path, what: str, /, **given: Any) -> T:
  """The ``cls`` in the JSON file ``path`` (``what``: the artifact, for a missing file)."""
  return decode(cls, artifacts.read_json(path, what), path, **given)
