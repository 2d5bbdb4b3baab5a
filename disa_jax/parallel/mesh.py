"""Device mesh construction with axes ('data', 'fsdp', 'tensor').

Axis types are `Auto`: shardings are propagated by the compiler from the parameter shardings and the
logical constraints the model adds, and user code keeps plain `jax.numpy` semantics.
(`jax.make_mesh` in recent JAX defaults to `Explicit` axes, which would make sharding part of every
array's type and require explicit resharding in model code; we do not want that.)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

MESH_AXES = ("data", "fsdp", "tensor")


def make_mesh(data: int = 1, fsdp: int = -1, tensor: int = 1,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A (data, fsdp, tensor) mesh with Auto axis types.

  Args:
    data, fsdp, tensor: axis sizes; at most one may be -1, meaning "all remaining devices".
    devices: the devices to use (default `jax.devices()`), laid out in order, tensor fastest.

  Raises:
    ValueError: sizes that are not positive (or -1) or whose product differs from the device count.
  """
  devices = list(jax.devices() if devices is None else devices)
  sizes = {"data": data, "fsdp": fsdp, "tensor": tensor}
  for name, size in sizes.items():
    if size != -1 and size < 1:
      raise ValueError(f"make_mesh: {name}={size}; sizes must be >= 1 or -1")
  free = [n for n, s in sizes.items() if s == -1]
  if len(free) > 1:
    raise ValueError(f"make_mesh: only one axis may be -1, got {free}")
  fixed = math.prod(s for s in sizes.values() if s != -1)
  if free:
    if len(devices) % fixed:
      raise ValueError(f"make_mesh: {len(devices)} devices not divisible by fixed sizes {sizes}")
    sizes[free[0]] = len(devices) // fixed
  shape = tuple(sizes[n] for n in MESH_AXES)
  if math.prod(shape) != len(devices):
    raise ValueError(f"make_mesh: sizes {dict(zip(MESH_AXES, shape))} need {math.prod(shape)} "
                     f"devices, have {len(devices)}")
  grid = np.asarray(devices, dtype=object).reshape(shape)  # [n] -> [data, fsdp, tensor]
  return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def batch_shards(mesh: Mesh) -> int:
  """How many ways a batch is split on ``mesh`` (the 'batch' rule: data x fsdp)."""
  return mesh.shape["data"] * mesh.shape["fsdp"]


def rows_for_mesh(rows: int, shards: int) -> int:
  """``rows`` rounded up to a multiple of ``shards`` (rows per micro-batch on a mesh whose batch
  is split ``shards`` ways: every device gets whole rows)."""
  return -(-rows // shards) * shards


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshConfig:
  """The device mesh of a stage, shared by every command's config.

  Attributes:
    data, fsdp, tensor: axis sizes; at most one may be -1 (all remaining devices).
    num_devices: use the first this many devices of `jax.devices()`; 0 = all.
  """
  data: int = 1
  fsdp: int = -1
  tensor: int = 1
  num_devices: int = 0

  def __post_init__(self):
    for name in ("data", "fsdp", "tensor"):
      size = getattr(self, name)
      if size != -1 and size < 1:
        raise ValueError(f"mesh.{name} must be >= 1 or -1, got {size!r}")
    if [self.data, self.fsdp, self.tensor].count(-1) > 1:
      raise ValueError(f"mesh: only one of data/fsdp/tensor may be -1, got "
                       f"{(self.data, self.fsdp, self.tensor)}")
    if self.num_devices < 0:
      raise ValueError(f"mesh.num_devices must be >= 0 (0 = all), got {self.num_devices!r}")

  def make(self, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The mesh over ``devices`` (default: the first ``num_devices`` of `jax.devices()`)."""
    if devices is None:
      devices = jax.devices()
      if self.num_devices:
        if self.num_devices > len(devices):
          raise ValueError(f"mesh.num_devices={self.num_devices} > {len(devices)} available devices")
        devices = devices[:self.num_devices]
    return make_mesh(self.data, self.fsdp, self.tensor, devices=devices)
