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
import math
from typing import Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MeshAxes = str | tuple[str, ...] | None
Rules = tuple[tuple[str, MeshAxes], ...]

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


def _check_divisible(spec: PartitionSpec, shape: Sequence[int], mesh: Mesh, what: str) -> None:
  for dim, (size, axes) in enumerate(zip(shape, spec)):
    if axes is None:
      continue
    flat = (axes,) if isinstance(axes, str) else tuple(axes)
    parts = math.prod(mesh.shape[a] for a in flat)
    if size % parts:
      raise ValueError(
          f"{what}: axis {dim} of size {size} is split over mesh axes {flat} of total size "
          f"{parts}, which does not divide it (shape {tuple(shape)}, spec {spec})")


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
    fitted = []
    for size, axes in zip(x.shape, spec):
      flat = () if axes is None else ((axes,) if isinstance(axes, str) else tuple(axes))
      parts = math.prod(self.mesh.shape[a] for a in flat)
      fitted.append(axes if parts and size % parts == 0 else None)
    return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, PartitionSpec(*fitted)))
