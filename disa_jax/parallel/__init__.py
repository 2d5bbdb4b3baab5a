"""Device meshes and logical-axis sharding rules (training vs sampling)."""

from disa_jax.parallel.mesh import MESH_AXES, MeshConfig, batch_shards, make_mesh, rows_for_mesh
from disa_jax.parallel.rules import (SAMPLING_RULES, TRAIN_RULES, Rules, ShardingContext,
                                     fit_spec, logical_to_sharding, logical_to_spec, param_sharding)
from disa_jax.parallel.sharding import model_shardings, param_logical_axes, shard_model

__all__ = [
    "MESH_AXES", "MeshConfig", "batch_shards", "make_mesh", "rows_for_mesh", "SAMPLING_RULES", "TRAIN_RULES", "Rules", "ShardingContext",
    "fit_spec", "logical_to_sharding", "logical_to_spec", "model_shardings", "param_logical_axes",
    "param_sharding",
    "shard_model",
]
