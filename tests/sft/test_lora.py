"""LoRA adapters on the stacked layer kernels: identity at init, adapter-only training, merge/export."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from disa_jax import models
from disa_jax.sft import SupervisedSchedule, make_sft_step
from disa_jax.sft import lora
from disa_jax.testing import make_tiny_model


def _ids(seed=0, b=2, t=12, vocab=60):
  return jnp.asarray(np.random.default_rng(seed).integers(3, vocab, (b, t)), jnp.int32)


def _train(model, steps=3, lr=1e-2):
  """``steps`` adapter-only updates of ``model`` (in place) on one padded batch; the losses."""
  graphdef, params, rest = nnx.split(model, lora.LoRAParam, ...)
  tx, step = make_sft_step(SupervisedSchedule(learning_rate=lr, total_steps=10, warmup_steps=0,
                                              schedule="constant"), graphdef, loss="batch_mean")
  opt_state = tx.init(params)
  ids = _ids(1, 4, 12)
  mask = jnp.ones_like(ids)
  batch = {"input_ids": ids, "attention_mask": mask, "response_mask": mask.at[:, :4].set(0)}
  losses = []
  for _ in range(steps):
    params, opt_state, loss = step(params, opt_state, rest, [batch])
    losses.append(float(loss))
  nnx.update(model, params)
  return losses


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
def test_zero_b_equals_base(family):
  model = make_tiny_model(family)
  ids = _ids()
  base = np.asarray(model(ids))
  lora.apply_lora(model, lora.LoRAConfig(rank=4, alpha=8.0))
  np.testing.assert_array_equal(np.asarray(model(ids)), base)
  c = model.config
  # q, k, v, o, gate, up, down: A [L, *in, r] + B [L, r, *out] scalars.
  per_layer = 4 * (c.hidden_size + c.num_heads * c.head_dim)           # q
  per_layer += 2 * 4 * (c.hidden_size + c.num_kv_heads * c.head_dim)  # k, v
  per_layer += 4 * (c.num_heads * c.head_dim + c.hidden_size)          # o
  per_layer += 3 * 4 * (c.hidden_size + c.intermediate_size)          # gate, up, down
  assert lora.lora_param_count(model) == c.num_layers * per_layer


def test_delta_matches_einsum_per_kernel():
  a = jax.random.normal(jax.random.key(0), (2, 3, 5, 4))  # [L, N, H, r] (o kernel: 2 input axes)
  b = jax.random.normal(jax.random.key(1), (2, 4, 7))     # [L, r, D]
  want = jnp.einsum("lnhr,lrd->lnhd", a, b)
  np.testing.assert_allclose(lora.lora_delta(a, b, 2), want, rtol=1e-6, atol=1e-6)


def test_training_changes_only_adapters():
  model = make_tiny_model("qwen2")
  lora.apply_lora(model, lora.LoRAConfig(rank=4, alpha=8.0))
  before_base = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Not(lora.LoRAParam))))
  before_lora = jax.tree.map(np.asarray, lora.lora_state_dict(model))
  losses = _train(model)
  assert losses[-1] < losses[0]
  after_base = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Not(lora.LoRAParam))))
  jax.tree.map(np.testing.assert_array_equal, after_base, before_base)
  after_lora = lora.lora_state_dict(model)
  for name in lora.ALL_TARGETS:
    assert np.abs(np.asarray(after_lora["layers"][f"{name}_lora_b"])).max() > 0, name
    assert not np.array_equal(after_lora["layers"][f"{name}_lora_a"],
                              before_lora["layers"][f"{name}_lora_a"]), name


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_merged_export_equals_adapted_and_reloads(family, tmp_path):
  model = make_tiny_model(family)
  lora.apply_lora(model, lora.LoRAConfig(rank=4, alpha=8.0))
  _train(model, steps=2)
  ids = _ids(3)
  adapted = np.asarray(model(ids))
  merged = lora.merge_lora(model)
  assert not lora.has_lora(merged) and lora.has_lora(model)
  np.testing.assert_allclose(np.asarray(merged(ids)), adapted, atol=1e-5, rtol=0)
  models.save_pretrained(merged, str(tmp_path))
  reloaded = models.from_pretrained(str(tmp_path))
  err = float(np.abs(np.asarray(reloaded(ids)) - adapted).max())
  assert err <= 1e-5, err
  base = make_tiny_model(family)
  assert float(np.abs(np.asarray(base(ids)) - adapted).max()) > 1e-4  # the export is not the base


def test_bad_config_names_field():
  with pytest.raises(ValueError, match="rank"):
    lora.LoRAConfig(rank=0)
  with pytest.raises(ValueError, match="targets"):
    lora.LoRAConfig(targets=("qkv",))
  model = make_tiny_model()
  with pytest.raises(ValueError, match="no LoRA"):
    lora.merge_lora(model)
  lora.apply_lora(model, lora.LoRAConfig(rank=2))
  with pytest.raises(ValueError, match="already"):
    lora.apply_lora(model, lora.LoRAConfig(rank=2))
