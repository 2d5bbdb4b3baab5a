"""`workflows.export`: a Stage 3 checkpoint -> sharded safetensors with an index, bf16 by default,
loaded by `transformers` and by our loader."""
import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from disa_jax import models, testing
from disa_jax.checkpoint import CheckpointManager
from disa_jax.workflows.export import export_policy


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
  """A Stage 3 workdir with one checkpoint whose params are the backbone's plus 0.5."""
  root = tmp_path_factory.mktemp("run")
  backbone = testing.save_tiny_checkpoint(str(root / "backbone"), family="qwen2")
  model = models.from_pretrained(backbone)
  params = jax_tree_plus(nnx.to_pure_dict(nnx.state(model, nnx.Param)), 0.5)
  (root / "config.json").write_text(json.dumps(
      {"model": {"policy_path": backbone, "param_dtype": "float32"}}))
  ckpt = CheckpointManager(root / "checkpoints", async_save=False)
  ckpt.save(3, {"params": params, "step": jnp.asarray(3)}, {"rl_step": 3}, force=True)
  ckpt.close()
  return root, backbone


def jax_tree_plus(tree, x):
  return {k: jax_tree_plus(v, x) if isinstance(v, dict) else v + x for k, v in tree.items()}


def test_export_is_sharded_bf16_with_an_index_that_transformers_loads(run_dir, tmp_path):
  root, backbone = run_dir
  out = export_policy(root, tmp_path / "bf16", max_shard_bytes=40_000)
  index = json.loads((tmp_path / "bf16" / "model.safetensors.index.json").read_text())
  shards = sorted(set(index["weight_map"].values()))
  assert len(shards) > 1 and not (tmp_path / "bf16" / "model.safetensors").exists()
  stored = {}
  for shard in shards:
    with safe_open(str(tmp_path / "bf16" / shard), framework="np") as f:
      stored.update({k: f.get_tensor(k) for k in f.keys()})
      assert all(index["weight_map"][k] == shard for k in f.keys())
  want = models.to_hf_state_dict(models.from_pretrained(backbone))
  assert set(index["weight_map"]) == set(stored) == set(want)  # every tensor, listed once
  assert {str(v.dtype) for v in stored.values()} == {"bfloat16"}
  assert index["metadata"]["total_size"] == sum(v.nbytes for v in stored.values())
  hf = AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32)
  name = "model.layers.0.self_attn.q_proj.weight"
  np.testing.assert_allclose(hf.state_dict()[name].numpy(), want[name] + 0.5, atol=1e-2)
  ours = models.to_hf_state_dict(models.from_pretrained(out))
  np.testing.assert_allclose(ours[name], want[name] + 0.5, atol=1e-2)


def test_export_float32_on_request(run_dir, tmp_path):
  root, backbone = run_dir
  out = export_policy(root, tmp_path / "f32", dtype="float32")
  got = models.to_hf_state_dict(models.from_pretrained(out))
  want = models.to_hf_state_dict(models.from_pretrained(backbone))
  assert all(v.dtype == np.float32 for v in got.values())
  np.testing.assert_allclose(got["model.norm.weight"], want["model.norm.weight"] + 0.5, atol=1e-6)
  with pytest.raises(ValueError, match="export dtype must be one of .*got 'float16'"):
    export_policy(root, tmp_path / "f16", dtype="float16")
