"""Test helpers: tiny random `transformers` (torch) models of each family, saved as safetensors."""

from __future__ import annotations

import numpy as np
import torch
import transformers

HF_CONFIGS = {
    "qwen2": lambda: transformers.Qwen2Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=10000.0,
        max_position_embeddings=512, tie_word_embeddings=False),
    "qwen3": lambda: transformers.Qwen3Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=24, rms_norm_eps=1e-6,
        rope_theta=1_000_000.0, max_position_embeddings=512, tie_word_embeddings=True),
    "llama": lambda: transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
        max_position_embeddings=512, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64}),
}


def make_hf_model(family: str, seed: int = 0) -> transformers.PreTrainedModel:
  """A random float32 HF model; norms and biases perturbed so that they matter, larger init."""
  torch.manual_seed(seed)
  config = HF_CONFIGS[family]()
  model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name:
        p.copy_(1.0 + 0.1 * torch.randn_like(p))
      elif name.endswith("bias"):
        p.copy_(0.1 * torch.randn_like(p))
      else:
        p.copy_(0.05 * torch.randn_like(p))
  return model


def hf_forward(model, ids: np.ndarray, attention_mask: np.ndarray | None = None,
               positions: np.ndarray | None = None):
  """(logits [B,T,V], hidden_states tuple) as float32 numpy."""
  kwargs = {}
  if attention_mask is not None:
    kwargs["attention_mask"] = torch.tensor(attention_mask)
  if positions is not None:
    kwargs["position_ids"] = torch.tensor(positions)
  with torch.no_grad():
    out = model(torch.tensor(ids), output_hidden_states=True, **kwargs)
  return (out.logits.float().numpy(), [h.float().numpy() for h in out.hidden_states])
