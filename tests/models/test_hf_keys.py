"""HF state-dict exchange: key table coverage, loud errors, tied heads, tiny checkpoints."""

import json
import os

import ml_dtypes
import numpy as np
import pytest
import transformers
from safetensors.numpy import load_file, save_file

import jax.numpy as jnp

from disa_jax import models, testing


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
@pytest.mark.slow
def test_state_dict_round_trip_in_memory(family):
  a = testing.make_tiny_model(family, seed=0)
  b = testing.make_tiny_model(family, seed=1)
  sd = models.to_hf_state_dict(a)
  assert set(sd) == set(models.expected_hf_keys(a.config))
  if family == "qwen3":
    assert "lm_head.weight" not in sd and "model.layers.1.self_attn.q_norm.weight" in sd
  if family == "qwen2":
    assert sd["model.layers.0.self_attn.q_proj.bias"].shape == (64,)
  models.load_hf_state_dict(b, sd)
  ids = jnp.arange(12, dtype=jnp.int32).reshape(2, 6)
  np.testing.assert_array_equal(np.asarray(a(ids)), np.asarray(b(ids)))


def test_load_errors_name_the_key():
  model = testing.make_tiny_model("qwen2")
  sd = models.to_hf_state_dict(model)
  missing = dict(sd)
  del missing["model.layers.1.mlp.up_proj.weight"]
  with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight"):
    models.load_hf_state_dict(model, missing)
  extra = dict(sd, **{"model.layers.2.mlp.up_proj.weight": sd["model.layers.1.mlp.up_proj.weight"]})
  with pytest.raises(ValueError, match="model.layers.2.mlp.up_proj.weight"):
    models.load_hf_state_dict(model, extra)
  bad = dict(sd)
  bad["model.layers.0.self_attn.k_proj.weight"] = np.zeros((16, 64), np.float32)
  with pytest.raises(ValueError, match=r"k_proj.weight.*shape \(16, 64\), expected \(32, 64\)"):
    models.load_hf_state_dict(model, bad)


def test_load_refuses_a_tensor_of_the_wrong_dtype_class(tmp_path):
  """Finding 10: an int32 norm weight (right shape) must not load silently as float; a float16 or
  bfloat16 tensor into a float32 model is fine."""
  model = testing.make_tiny_model("qwen3")
  sd = models.to_hf_state_dict(model)
  name = "model.layers.0.input_layernorm.weight"
  for wrong in (np.int32, np.uint8, np.bool_):
    bad = dict(sd, **{name: np.ones(sd[name].shape, wrong)})
    with pytest.raises(ValueError, match=rf"{name}.*dtype {np.dtype(wrong)}.*expected a float"):
      models.load_hf_state_dict(model, bad)
  fine = dict(sd, **{name: sd[name].astype(ml_dtypes.bfloat16),
                     "model.norm.weight": sd["model.norm.weight"].astype(np.float16)})
  models.load_hf_state_dict(model, fine)
  # through a checkpoint directory (safetensors) as from_pretrained reads it
  models.save_pretrained(model, str(tmp_path / "m"))
  tensors = load_file(str(tmp_path / "m" / "model.safetensors"))
  tensors[name] = np.ones(tensors[name].shape, np.int32)
  save_file(tensors, str(tmp_path / "m" / "model.safetensors"), metadata={"format": "pt"})
  with pytest.raises(ValueError, match=rf"{name}.*dtype int32"):
    models.from_pretrained(str(tmp_path / "m"))


def test_tied_checkpoint_may_carry_equal_lm_head():
  model = testing.make_tiny_model("qwen3")
  sd = models.to_hf_state_dict(model)
  models.load_hf_state_dict(model, dict(sd, **{"lm_head.weight": sd["model.embed_tokens.weight"]}))
  with pytest.raises(ValueError, match="lm_head.weight"):
    models.load_hf_state_dict(
        model, dict(sd, **{"lm_head.weight": sd["model.embed_tokens.weight"] + 1}))


def test_tiny_checkpoint_directory(tmp_path):
  path = testing.save_tiny_checkpoint(str(tmp_path / "ckpt"), "qwen3", seed=2)
  with open(os.path.join(path, "config.json")) as f:
    assert json.load(f)["architectures"] == ["Qwen3ForCausalLM"]
  model = models.from_pretrained(path)
  ref = testing.make_tiny_model("qwen3", seed=2)
  ids = jnp.arange(10, dtype=jnp.int32)[None]
  np.testing.assert_array_equal(np.asarray(model(ids)), np.asarray(ref(ids)))
  tok = transformers.AutoTokenizer.from_pretrained(path)
  mine = testing.make_tokenizer()
  text = "the answer is \\boxed{123}\n"
  assert tok(text)["input_ids"] == mine(text)["input_ids"]
  assert tok.decode(mine(text)["input_ids"]) == text
  assert tok.eos_token_id == 2 and tok.pad_token_id == 0
  chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                 tokenize=False)
  assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
  # bf16 save/load
  bf = models.save_pretrained(model, str(tmp_path / "bf16"), dtype=jnp.bfloat16)
  m16 = models.from_pretrained(bf, dtype=jnp.bfloat16)
  assert m16.embed[...].dtype == jnp.bfloat16
  with open(os.path.join(bf, "config.json")) as f:
    assert json.load(f)["torch_dtype"] == "bfloat16"
