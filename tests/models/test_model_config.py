"""ModelConfig: HF config translation, presets, validation."""

import json

import pytest
import transformers

from disa_jax import models
from disa_jax.models import ModelConfig, RopeScaling

from .hf_utils import HF_CONFIGS


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
def test_from_hf_config_reads_transformers_configs(family):
  hf = HF_CONFIGS[family]().to_dict()
  c = ModelConfig.from_hf_config(hf)
  assert c.family == family and c.num_layers == 2 and c.num_kv_heads == 2
  assert c.qkv_bias == (family == "qwen2") and c.o_bias is False
  assert c.qk_norm == (family == "qwen3")
  assert c.head_dim == (24 if family == "qwen3" else 16)
  if family == "llama":
    assert c.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 64)
    assert c.rope_theta == 500000.0
  # our config.json is read back by transformers into the same config
  again = transformers.AutoConfig.for_model(**c.to_hf_config())
  assert ModelConfig.from_hf_config(again.to_dict()) == c


def test_legacy_rope_scaling_key():
  hf = HF_CONFIGS["llama"]().to_dict()
  params = hf.pop("rope_parameters")
  hf["rope_theta"] = params.pop("rope_theta")
  params["type"] = params.pop("rope_type")
  hf["rope_scaling"] = params
  c = ModelConfig.from_hf_config(hf)
  assert c.rope_scaling.rope_type == "llama3" and c.rope_theta == 500000.0


def test_presets_have_published_dims():
  q = models.get_preset("qwen3-4b-base")
  assert (q.hidden_size, q.num_layers, q.num_heads, q.num_kv_heads, q.head_dim) == (
      2560, 36, 32, 8, 128)
  assert q.tie_word_embeddings and q.qk_norm and q.vocab_size == 151936
  assert models.get_preset("qwen3-4b-instruct-2507").rope_theta == 5_000_000.0
  q7 = models.get_preset("qwen2.5-7b")
  assert q7.qkv_bias and q7.num_kv_heads == 4 and q7.intermediate_size == 18944
  assert models.get_preset("qwen3-0.6b").hidden_size == 1024
  q17 = models.get_preset("qwen3-1.7b")
  assert (q17.hidden_size, q17.intermediate_size, q17.num_layers, q17.num_heads) == (
      2048, 6144, 28, 16)
  assert models.get_preset("llama-3-8b").vocab_size == 128256
  for name, cfg in models.PRESETS.items():
    json.dumps(cfg.to_hf_config())  # serialisable
    assert ModelConfig.from_hf_config(cfg.to_hf_config()) == cfg, name
  with pytest.raises(ValueError, match="unknown model preset"):
    models.get_preset("gpt2")


def test_bad_values_name_the_field():
  base = models.get_preset("qwen3-0.6b")
  with pytest.raises(ValueError, match="num_heads=16 must be a multiple of num_kv_heads=3"):
    base.replace(num_kv_heads=3)
  with pytest.raises(ValueError, match="family='gpt2'"):
    base.replace(family="gpt2")
  with pytest.raises(ValueError, match="rope_type='yarn'"):
    RopeScaling("yarn", 4.0)
  hf = HF_CONFIGS["qwen2"]().to_dict()
  hf["use_sliding_window"] = True
  with pytest.raises(ValueError, match="use_sliding_window"):
    ModelConfig.from_hf_config(hf)
  with pytest.raises(ValueError, match="model_type='mistral'"):
    ModelConfig.from_hf_config({**hf, "model_type": "mistral"})
