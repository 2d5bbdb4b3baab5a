"""Placing an NNX model's parameters on a mesh from their logical axis names."""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from disa_jax.parallel.rules import Rules, ShardingContext, param_sharding, say_fallbacks


def param_logical_axes(variable: nnx.Variable) -> tuple[str | None, ...]:
  """The `logical_axes` metadata of a parameter (error naming the shape if it has none)."""
  axes = variable.get_metadata().get("logical_axes")
  value = variable.get_value()  # an array, or a jax.ShapeDtypeStruct of an abstract model
  if axes is None:
    raise ValueError(f"parameter of shape {value.shape} has no 'logical_axes' metadata")
  if len(axes) != value.ndim:
    raise ValueError(f"logical axes {axes} do not match parameter shape {value.shape}")
  return tuple(axes)


def model_shardings(model: nnx.Module, mesh: Mesh, rules: Rules) -> Any:
  """An nnx.State of NamedSharding, one per parameter of `model` (concrete, or abstract from
  `nnx.eval_shape`).

  A parameter dimension that its mesh axes do not divide falls back (`disa_jax.parallel.rules.
  fit_spec`); the parameters concerned are logged once, in one line.
  """
  state = nnx.state(model, nnx.Param)
  fallbacks = []

  def one(path, v):
    sharding, fell_back = param_sharding(param_logical_axes(v), v.get_value().shape, mesh, rules)
    if fell_back:
      fallbacks.append(f"{jax.tree_util.keystr(path, simple=True, separator='.')}: {sharding.spec}")
    return sharding

  shardings = jax.tree_util.tree_map_with_path(one, state,
                                               is_leaf=lambda x: isinstance(x, nnx.Variable))
  say_fallbacks(fallbacks, mesh)
  return shardings


def shard_model(model: nnx.Module, mesh: Mesh, rules: Rules) -> nnx.Module:
  """Moves every parameter to its sharding and attaches the activation `ShardingContext`.

  Modifies `model` in place and returns it. Modules with a `sharding` attribute (our `Transformer`)
  get `ShardingContext(mesh, rules)` so that their activation constraints use the same rules.
  """
  state = nnx.state(model, nnx.Param)
  shardings = model_shardings(model, mesh, rules)
  placed = jax.tree.map(
      lambda v, s: v.replace(jax.device_put(v[...], s)), state, shardings,
      is_leaf=lambda x: isinstance(x, nnx.Variable))
  nnx.update(model, placed)
  if hasattr(model, "sharding"):
    model.sharding = ShardingContext(mesh, rules)
  return model


def is_sharded_as(array: jax.Array, sharding: NamedSharding) -> bool:
  """Whether `array` is laid out as `sharding` (equivalent device assignment and spec)."""
  return array.sharding.is_equivalent_to(sharding, array.ndim)
