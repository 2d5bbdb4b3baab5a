"""Flax NNX decoders (Qwen2/2.5, Qwen3, Llama-3 dense) with Hugging Face checkpoint interop."""

from disa_jax.models.config import PRESETS, ModelConfig, RopeScaling, get_preset
from disa_jax.models.transformer import ModelOptions, Transformer

__all__ = ["PRESETS", "ModelConfig", "RopeScaling", "get_preset", "ModelOptions", "Transformer"]
from disa_jax.models.hf_interop import (KEY_TABLE, KeyRule, expected_hf_keys, from_pretrained,
                                        host_state_dict, load_config, load_hf_state_dict,
                                        read_checkpoint_tensors, save_pretrained,
                                        to_hf_state_dict)

__all__ += ["KEY_TABLE", "KeyRule", "expected_hf_keys", "from_pretrained", "host_state_dict",
            "load_config", "load_hf_state_dict", "read_checkpoint_tensors", "save_pretrained",
            "to_hf_state_dict"]
