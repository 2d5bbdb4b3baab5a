"""Sharded forward and gradients on 8 fake CPU devices equal the single-device ones."""

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AxisType, PartitionSpec

from disa_jax import parallel, scoring, testing
from disa_jax.rl.config import RolloutConfig

MESHES = [dict(data=2, fsdp=2, tensor=2), dict(data=1, fsdp=4, tensor=2),
          pytest.param(dict(data=8, fsdp=1, tensor=1), marks=pytest.mark.slow),
          pytest.param(dict(data=1, fsdp=8, tensor=1), marks=pytest.mark.slow)]


@pytest.fixture(scope="module")
def reference():
  model = testing.make_tiny_model("qwen2", seed=7)
  rng = np.random.default_rng(0)
  ids = jnp.asarray(rng.integers(5, 120, size=(8, 16)), jnp.int32)
  mask = jnp.ones_like(ids).at[0, :4].set(0).at[3, -3:].set(0)
  logits = nnx.jit(lambda m, i, k: m(i, attention_mask=k))(model, ids, mask)
  grads = nnx.jit(nnx.grad(lambda m, i, k: _loss(m, i, k)))(model, ids, mask)
  return model, ids, mask, logits, grads


def _loss(model, ids, mask):
  lp = scoring.token_logprobs(model, ids, mask, chunk_size=32)
  return -jnp.mean(scoring.sequence_logprob(lp, mask, normalize=True))


def test_make_mesh_axes_and_errors():
  mesh = parallel.make_mesh(data=2, fsdp=-1, tensor=2)
  assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
  assert all(t == AxisType.Auto for t in mesh.axis_types)
  with pytest.raises(ValueError, match="need 12 devices, have 8"):
    parallel.make_mesh(data=3, fsdp=2, tensor=2)
  with pytest.raises(ValueError, match="only one axis may be -1"):
    parallel.make_mesh(data=-1, fsdp=-1)
  with pytest.raises(ValueError, match="tensor=0"):
    parallel.make_mesh(tensor=0)


def test_rules_resolution():
  spec = parallel.logical_to_spec(("layers", "embed", "q_heads", "head_dim"), parallel.TRAIN_RULES)
  assert spec == PartitionSpec(None, "fsdp", "tensor", None)
  spec = parallel.logical_to_spec(("layers", "embed", "q_heads", "head_dim"),
                                  parallel.SAMPLING_RULES)
  assert spec == PartitionSpec(None, None, "tensor", None)
  assert parallel.logical_to_spec(("batch", "seq"), parallel.TRAIN_RULES) == PartitionSpec(
      ("data", "fsdp"), None)
  with pytest.raises(ValueError, match="'nonsense' has no entry"):
    parallel.logical_to_spec(("nonsense",), parallel.TRAIN_RULES)
  with pytest.raises(ValueError, match="used twice"):
    parallel.logical_to_spec(("mlp", "q_heads"), parallel.TRAIN_RULES)
  mesh = parallel.make_mesh(data=1, fsdp=8, tensor=1)
  with pytest.raises(ValueError, match="size 12 is split over mesh axes \\('fsdp',\\)"):
    parallel.logical_to_sharding(("embed",), mesh, parallel.TRAIN_RULES, shape=(12,))


@pytest.mark.parametrize("mesh_shape", MESHES, ids=["2x2x2", "1x4x2", "8x1x1", "1x8x1"])
@pytest.mark.slow
def test_sharded_forward_and_gradient_equal_single_device(reference, mesh_shape):
  model, ids, mask, ref_logits, ref_grads = reference
  mesh = parallel.make_mesh(**mesh_shape)
  sharded = parallel.shard_model(nnx.clone(model), mesh, parallel.TRAIN_RULES)
  q = sharded.layers.q_kernel[...]
  assert q.sharding.spec == PartitionSpec(None, "fsdp", "tensor", None)
  n_shards = mesh_shape["fsdp"] * mesh_shape["tensor"]
  assert q.addressable_shards[0].data.size == q.size // n_shards
  logits = nnx.jit(lambda m, i, k: m(i, attention_mask=k))(sharded, ids, mask)
  np.testing.assert_allclose(np.asarray(logits), np.asarray(ref_logits), atol=1e-5)
  grads = nnx.jit(nnx.grad(lambda m, i, k: _loss(m, i, k)))(sharded, ids, mask)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref_grads)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, err_msg=str(path))


def test_sampling_rules_replicate_over_fsdp(reference):
  model, ids, mask, ref_logits, _ = reference
  mesh = parallel.make_mesh(data=4, fsdp=1, tensor=2)
  sharded = parallel.shard_model(nnx.clone(model), mesh, parallel.SAMPLING_RULES)
  assert sharded.embed[...].sharding.spec == PartitionSpec("tensor", None)
  logits = nnx.jit(lambda m, i, k: m(i, attention_mask=k))(sharded, ids, mask)
  np.testing.assert_allclose(np.asarray(logits), np.asarray(ref_logits), atol=1e-5)


def test_fit_spec_moves_or_replicates_what_the_mesh_does_not_divide():
  mesh = parallel.make_mesh(data=1, fsdp=6, tensor=1, devices=jax.devices()[:6])
  spec = parallel.logical_to_spec(("layers", "embed", "q_heads", "head_dim"), parallel.TRAIN_RULES)
  # Qwen3-4B's q kernel: 2560 is not a multiple of 6, the 36 layers are: fsdp moves there.
  assert parallel.fit_spec(spec, (36, 2560, 32, 128), mesh) == PartitionSpec(
      "fsdp", None, "tensor", None)
  # Nothing divisible by 6: replicated along fsdp.
  assert parallel.fit_spec(spec, (2, 64, 4, 16), mesh) == PartitionSpec(None, None, "tensor", None)
  assert parallel.fit_spec(spec, (2, 60, 4, 16), mesh) == spec  # fits: unchanged
  with pytest.raises(ValueError, match="differ in rank"):
    parallel.param_sharding(("embed",), (6, 6), mesh, parallel.TRAIN_RULES)


@pytest.mark.parametrize("n", [6, pytest.param(3, marks=pytest.mark.slow),
                               pytest.param(5, marks=pytest.mark.slow)])
def test_mesh_that_divides_no_dimension_still_trains(reference, n, caplog):
  """fsdp = 6 / 3 / 5 over a d=64 model with a 2-layer stack: the rules fall back (one log line
  naming the parameters) and forward and gradients equal the single-device ones."""
  model, ids, mask, ref_logits, ref_grads = reference
  mesh = parallel.make_mesh(data=1, fsdp=n, tensor=1, devices=jax.devices()[:n])
  with caplog.at_level("WARNING", logger="disa_jax.parallel"):
    sharded = parallel.shard_model(nnx.clone(model), mesh, parallel.TRAIN_RULES)
    parallel.shard_model(nnx.clone(model), mesh, parallel.TRAIN_RULES)  # e.g. the reference
  lines = [r.getMessage() for r in caplog.records if r.name == "disa_jax.parallel"]
  assert len(lines) == 1 and "layers.q_kernel" in lines[0] and "embed" in lines[0], lines
  assert sharded.layers.q_kernel[...].sharding.spec == PartitionSpec(None, None, "tensor", None)
  logits = nnx.jit(lambda m, i, k: m(i, attention_mask=k))(sharded, ids, mask)
  np.testing.assert_allclose(np.asarray(logits), np.asarray(ref_logits), atol=1e-5)
  grads = nnx.jit(nnx.grad(lambda m, i, k: _loss(m, i, k)))(sharded, ids, mask)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref_grads)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, err_msg=str(path))


def test_micro_batch_rows_follow_the_mesh():
  for shards, rows in ((1, 8), (6, 12), (3, 9), (5, 10), (16, 16), (24, 24), (32, 32)):
    assert parallel.rows_for_mesh(8, shards) == rows
    assert RolloutConfig(micro_batch_rows=8).layout([10], 16, shards).rows == rows
    assert RolloutConfig(micro_batch_rows=8, packing=False).layout([10], 16, shards).rows == rows
  assert parallel.batch_shards(parallel.make_mesh(data=2, fsdp=3, tensor=1,
                                                  devices=jax.devices()[:6])) == 6
