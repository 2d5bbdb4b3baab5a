"""Logical axis names -> mesh axes: the rules tables and their resolution.

Model code names array axes logically ('embed', 'mlp', 'batch', ...). A rules table, one per use,
says which mesh axis (of 'data', 'fsdp', 'tensor') each logical axis is split over:

- `TRAIN_RULES`: parameters split over fsdp (the embed axis) and tensor (heads / mlp / vocab);
  the batch over data x fsdp.
- `SAMPLING_RULES`: tensor parallelism only; parameters are replicated over data/fsdp and the
  batch is split over data x fsdp.

A rules table is a tuple of `(logical_name, mesh_axes)` pairs, `mesh_axes` a mesh axis name, a tuple
of names, or None (replicated). Every logical name used must appear in the table.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MeshAxes = str | tuple[str, ...] | None
Rules = tuple[tuple[str, MeshAxes], ...]

_LOG = logging.getLogger("disa_jax.parallel")

_COMMON: Rules = (
    ("batch", ("data", "fsdp")),
    ("seq", None),
    ("layers", None),
    ("head_dim", None),
    ("norm", None),
    ("vocab", "tensor"),
    ("q_heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("act_embed", None),
    ("act_heads", "tensor"),
    ("act_kv_heads", "tensor"),
    ("act_mlp", "tensor"),
    ("act_vocab", "tensor"),
)

TRAIN_RULES: Rules = _COMMON + (("embed", "fsdp"),)
SAMPLING_RULES: Rules = _COMMON + (("embed", None),)


def logical_to_spec(logical_axes: Sequence[str | None], rules: Rules) -> PartitionSpec:
  """PartitionSpec for an array whose axes have the given logical names.

  Args:
    logical_axes: one logical name (or None = replicated) per array axis.
    rules: a rules table.

  Raises:
    ValueError: a logical name missing from the rules, or a mesh axis used by two array axes.
  """
  table = dict(rules)
  spec, used = [], set()
  for name in logical_axes:
    if name is None:
      spec.append(None)
      continue
    if name not in table:
      raise ValueError(f"logical axis {name!r} has no entry in the rules table {sorted(table)}")
    axes = table[name]
    flat = (axes,) if isinstance(axes, str) else tuple(axes or ())
    clash = used.intersection(flat)
    if clash:
      raise ValueError(
          f"mesh axes {sorted(clash)} used twice in logical axes {tuple(logical_axes)}")
    used.update(flat)
    spec.append(axes)
  return PartitionSpec(*spec)


def _flat(axes: MeshAxes) -> tuple[str, ...]:
  return () if axes is None else ((axes,) if isinstance(axes, str) else tuple(axes))


def _parts(axes: MeshAxes, mesh: Mesh) -> int:
  return math.prod(mesh.shape[a] for a in _flat(axes))


def _check_divisible(spec: PartitionSpec, shape: Sequence[int], mesh: Mesh, what: str) -> None:
  for dim, (size, axes) in enumerate(zip(shape, spec)):
    if axes is not None and size % _parts(axes, mesh):
      raise ValueError(
          f"{what}: axis {dim} of size {size} is split over mesh axes {_flat(axes)} of total size "
          f"{_parts(axes, mesh)}, which does not divide it (shape {tuple(shape)}, spec {spec})")


def logical_to_sharding(logical_axes: Sequence[str | None], mesh: Mesh, rules: Rules,
                        shape: Sequence[int] | None = None) -> NamedSharding:
  """NamedSharding for logical axes on `mesh`; checks divisibility when `shape` is given."""
  spec = logical_to_spec(logical_axes, rules)
  if shape is not None:
    if len(shape) != len(logical_axes):
      raise ValueError(
          f"shape {tuple(shape)} and logical axes {tuple(logical_axes)} differ in rank")
    _check_divisible(spec, shape, mesh, f"logical axes {tuple(logical_axes)}")
  return NamedSharding(mesh, spec)


def fit_spec(spec: PartitionSpec, shape: Sequence[int], mesh: Mesh) -> PartitionSpec:
  """``spec`` made valid for an array of ``shape`` on ``mesh`` (the rules' fallback).

  JAX places an array only when every split dimension is a multiple of its mesh axes' total size
  (no uneven or padded shards for `device_put` / `make_array_from_callback`). A dimension that its
  mesh axes do not divide gives them up; they move to the largest unsplit dimension they divide
  (the parameter stays sharded, along another axis), or, if there is none, that dimension is
  replicated along them. A spec that already fits is returned unchanged.
  """
  entries = list(spec) + [None] * (len(shape) - len(spec))
  loose = []
  for dim, (size, axes) in enumerate(zip(shape, entries)):
    if axes is not None and size % _parts(axes, mesh):
      loose.append(axes)
      entries[dim] = None
  for axes in loose:
    free = [d for d, (size, a) in enumerate(zip(shape, entries))
            if a is None and size % _parts(axes, mesh) == 0 and not _used(entries, axes)]
    if free:
      entries[max(free, key=lambda d: shape[d])] = axes
  return PartitionSpec(*entries)


def param_sharding(logical_axes: Sequence[str | None], shape: Sequence[int], mesh: Mesh,
                   rules: Rules) -> tuple[NamedSharding, bool]:
  """A parameter's sharding from its logical axes, with the `fit_spec` fallback.

  Returns:
    (the sharding, whether the fallback changed the rules' spec).
  """
  if len(shape) != len(logical_axes):
    raise ValueError(f"shape {tuple(shape)} and logical axes {tuple(logical_axes)} differ in rank")
  spec = logical_to_spec(logical_axes, rules)
  fitted = fit_spec(spec, shape, mesh)
  return NamedSharding(mesh, fitted), fitted != spec


_SAID: set[tuple] = set()  # the fallbacks already logged (a policy and its reference say it once)


def say_fallbacks(fallbacks: Sequence[str], mesh: Mesh) -> None:
  """Logs, in one line, the parameters whose rules' sharding did not fit ``mesh`` (once per
  process for the same mesh and parameters)."""
  key = (tuple(mesh.shape.items()), tuple(fallbacks))
  if fallbacks and key not in _SAID:
    _SAID.add(key)
    _LOG.warning("mesh %s does not divide %d parameter(s) as the rules split them; sharded along "
                 "another axis or replicated instead (parameter: spec): %s",
                 dict(mesh.shape), len(fallbacks), "; ".join(fallbacks))


def _used(entries: Sequence[MeshAxes], axes: MeshAxes) -> bool:
  taken = {a for e in entries for a in _flat(e)}
  return bool(taken.intersection(_flat(axes)))


@dataclasses.dataclass(frozen=True)
class ShardingContext:
  """A mesh and a rules table, attached to a model to constrain its activations."""

  mesh: Mesh
  rules: Rules

  def constrain(self, x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
    """`with_sharding_constraint` of x to the sharding its logical axes map to.

    A mesh axis group that does not divide its array axis is left out for that axis (the array is
    replicated along it instead); activations such as a batch of 1 while decoding hit this.
    """
    spec = logical_to_spec(logical_axes, self.rules)
    fitted = [axes if size % _parts(axes, self.mesh) == 0 else None
              for size, axes in zip(x.shape, spec)]
    return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, PartitionSpec(*fitted)))
