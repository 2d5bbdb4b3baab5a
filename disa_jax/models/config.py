"""Architecture configuration for the generic decoder (Qwen2/2.5, Qwen3, Llama-3).

`ModelConfig` is a frozen dataclass with one field per architectural choice. Each field's comment
names the Hugging Face `config.json` key it is read from, so `from_hf_config` / `to_hf_config` are a
direct translation. Runtime choices (dtypes, remat, sharding) are not part of this config; they are
arguments of `Transformer`.

Presets carry the published dimensions of the models the paper uses.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

_FAMILIES = ("qwen2", "qwen3", "llama")
_ARCHITECTURES = {
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "llama": "LlamaForCausalLM",
}
_ROPE_TYPES = ("linear", "llama3")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """RoPE frequency scaling (HF `rope_parameters` / legacy `rope_scaling`).

  Only the types that change the inverse frequencies without position-dependent attention factors
  are supported: 'linear' and 'llama3'.
  """

  rope_type: str  # 'rope_type' (legacy: 'type')
  factor: float  # 'factor'
  low_freq_factor: float = 1.0  # 'low_freq_factor' (llama3 only)
  high_freq_factor: float = 4.0  # 'high_freq_factor' (llama3 only)
  original_max_position_embeddings: int = 8192  # 'original_max_position_embeddings' (llama3 only)

  def __post_init__(self):
    if self.rope_type not in _ROPE_TYPES:
      raise ValueError(
          f"RopeScaling.rope_type={self.rope_type!r} is not supported; "
          f"expected one of {_ROPE_TYPES}"
      )
    if self.factor <= 0:
      raise ValueError(f"RopeScaling.factor must be > 0, got {self.factor}")
    if self.rope_type == "llama3" and not self.high_freq_factor > self.low_freq_factor:
      raise ValueError(
          "RopeScaling: llama3 needs high_freq_factor > low_freq_factor, got "
          f"{self.high_freq_factor} and {self.low_freq_factor}"
      )

  def to_hf(self, rope_theta: float) -> dict[str, Any]:
    """HF `rope_parameters` dict (also valid as legacy `rope_scaling`)."""
    out: dict[str, Any] = {"rope_type": self.rope_type, "factor": self.factor,
                           "rope_theta": rope_theta}
    if self.rope_type == "llama3":
      out.update(
          low_freq_factor=self.low_freq_factor,
          high_freq_factor=self.high_freq_factor,
          original_max_position_embeddings=self.original_max_position_embeddings,
      )
    return out


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Generic dense decoder configuration (field comment = HF config key)."""

  family: str  # 'model_type': 'qwen2' | 'qwen3' | 'llama'
  vocab_size: int  # 'vocab_size'
  hidden_size: int  # 'hidden_size'
  intermediate_size: int  # 'intermediate_size'
  num_layers: int  # 'num_hidden_layers'
  num_heads: int  # 'num_attention_heads'
  num_kv_heads: int  # 'num_key_value_heads'
  head_dim: int  # 'head_dim' (default hidden_size // num_attention_heads)
  rms_norm_eps: float = 1e-6  # 'rms_norm_eps'
  rope_theta: float = 10000.0  # 'rope_parameters.rope_theta' (legacy: 'rope_theta')
  rope_scaling: RopeScaling | None = None  # 'rope_parameters' (legacy 'rope_scaling'); None=default
  max_position_embeddings: int = 32768  # 'max_position_embeddings'
  tie_word_embeddings: bool = False  # 'tie_word_embeddings'
  qkv_bias: bool = False  # qwen2: always True; llama/qwen3: 'attention_bias'
  o_bias: bool = False  # qwen2: always False; llama/qwen3: 'attention_bias'
  qk_norm: bool = False  # qwen3: always True (per-head RMSNorm on q and k)
  bos_token_id: int | None = None  # 'bos_token_id'
  eos_token_id: int | tuple[int, ...] | None = None  # 'eos_token_id'
  pad_token_id: int | None = None  # 'pad_token_id'

  def __post_init__(self):
    if self.family not in _FAMILIES:
      raise ValueError(f"ModelConfig.family={self.family!r}; expected one of {_FAMILIES}")
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                 "num_kv_heads", "head_dim"):
      value = getattr(self, name)
      if not isinstance(value, int) or value <= 0:
        raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f"ModelConfig.num_heads={self.num_heads} must be a multiple of "
          f"num_kv_heads={self.num_kv_heads}"
      )
    if self.head_dim % 2:
      raise ValueError(f"ModelConfig.head_dim={self.head_dim} must be even for RoPE")
    if isinstance(self.eos_token_id, list):
      object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))

  @property
  def num_groups(self) -> int:
    """Query heads per key/value head (GQA group size)."""
    return self.num_heads // self.num_kv_heads

  @property
  def eos_token_ids(self) -> tuple[int, ...]:
    """`eos_token_id` as a tuple (empty when unset)."""
    if self.eos_token_id is None:
      return ()
    if isinstance(self.eos_token_id, int):
      return (self.eos_token_id,)
    return tuple(self.eos_token_id)

  def replace(self, **changes: Any) -> "ModelConfig":
    """A copy with some fields changed (validated again)."""
    return dataclasses.replace(self, **changes)

  # --------------------------------------------------------------------------------------------
  # Hugging Face config.json translation
  # --------------------------------------------------------------------------------------------

  @classmethod
  def from_hf_config(cls, hf: Mapping[str, Any]) -> "ModelConfig":
    """Reads an HF `config.json` dict (transformers 4.x `rope_scaling` or 5.x `rope_parameters`).

    Raises:
      ValueError: for a family other than qwen2/qwen3/llama, or a feature this model does not
        implement (sliding-window attention, MLP bias, non-SiLU activation, unsupported RoPE type).
    """
    family = hf.get("model_type")
    if family not in _FAMILIES:
      raise ValueError(f"config.json model_type={family!r} is not supported; expected {_FAMILIES}")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
      raise ValueError(f"config.json hidden_act={act!r} is not supported (only 'silu')")
    if hf.get("use_sliding_window", False):
      raise ValueError("config.json use_sliding_window=True is not supported")
    if hf.get("mlp_bias", False):
      raise ValueError("config.json mlp_bias=True is not supported")
    num_heads = int(hf["num_attention_heads"])
    hidden = int(hf["hidden_size"])
    head_dim = hf.get("head_dim") or hidden // num_heads
    rope_params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_params = dict(rope_params)
    rope_theta = float(rope_params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = rope_params.get("rope_type", rope_params.get("type", "default"))
    if rope_type == "default":
      rope_scaling = None
    else:
      extra = set(rope_params) - {"rope_type", "type", "rope_theta", "factor", "low_freq_factor",
                                  "high_freq_factor", "original_max_position_embeddings"}
      if extra:
        raise ValueError(f"config.json rope parameters {sorted(extra)} are not supported")
      rope_scaling = RopeScaling(
          rope_type=rope_type,
          factor=float(rope_params["factor"]),
          low_freq_factor=float(rope_params.get("low_freq_factor", 1.0)),
          high_freq_factor=float(rope_params.get("high_freq_factor", 4.0)),
          original_max_position_embeddings=int(
              rope_params.get("original_max_position_embeddings", 8192)),
      )
    attention_bias = bool(hf.get("attention_bias", False))
    eos = hf.get("eos_token_id")
    return cls(
        family=family,
        vocab_size=int(hf["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=int(hf.get("max_position_embeddings", 32768)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=True if family == "qwen2" else attention_bias,
        o_bias=False if family == "qwen2" else attention_bias,
        qk_norm=family == "qwen3",
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
        pad_token_id=hf.get("pad_token_id"),
    )

  def to_hf_config(self, dtype: str = "float32") -> dict[str, Any]:
    """An HF `config.json` dict that transformers (4.x and 5.x) and vLLM load.

    Args:
      dtype: the dtype name the weights are stored in ('float32' | 'bfloat16' | 'float16').

    Raises:
      ValueError: if this config cannot be expressed in its family's HF config (e.g. a Qwen2 config
        without qkv bias, or a Llama config with q/k norm).
    """
    if self.family == "qwen2" and (not self.qkv_bias or self.o_bias or self.qk_norm):
      raise ValueError("qwen2 configs need qkv_bias=True, o_bias=False, qk_norm=False")
    if self.family == "qwen3" and not self.qk_norm:
      raise ValueError("qwen3 configs need qk_norm=True")
    if self.family in ("llama", "qwen3") and self.qkv_bias != self.o_bias:
      raise ValueError(f"{self.family} configs need qkv_bias == o_bias (HF 'attention_bias')")
    if self.family == "llama" and self.qk_norm:
      raise ValueError("llama configs need qk_norm=False")
    hf: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[self.family]],
        "model_type": self.family,
        "vocab_size": self.vocab_size,
        "hidden_size": self.hidden_size,
        "intermediate_size": self.intermediate_size,
        "num_hidden_layers": self.num_layers,
        "num_attention_heads": self.num_heads,
        "num_key_value_heads": self.num_kv_heads,
        "head_dim": self.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": self.rms_norm_eps,
        "rope_theta": self.rope_theta,
        "max_position_embeddings": self.max_position_embeddings,
        "tie_word_embeddings": self.tie_word_embeddings,
        "bos_token_id": self.bos_token_id,
        "eos_token_id": list(self.eos_token_id) if isinstance(self.eos_token_id, tuple)
                        else self.eos_token_id,
        "pad_token_id": self.pad_token_id,
        "torch_dtype": dtype,
        "use_cache": True,
    }
    if self.rope_scaling is None:
      hf["rope_scaling"] = None
      hf["rope_parameters"] = {"rope_type": "default", "rope_theta": self.rope_theta}
    else:
      hf["rope_scaling"] = self.rope_scaling.to_hf(self.rope_theta)
      hf["rope_parameters"] = self.rope_scaling.to_hf(self.rope_theta)
    if self.family in ("llama", "qwen3"):
      hf["attention_bias"] = self.qkv_bias
    if self.family == "llama":
      hf["mlp_bias"] = False
    if self.family in ("qwen2", "qwen3"):
      hf["use_sliding_window"] = False
      hf["sliding_window"] = None
    return hf


def _qwen3(vocab, hidden, inter, layers, heads, kv, theta, max_pos, tie, eos) -> ModelConfig:
  return ModelConfig(
      family="qwen3", vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
      num_layers=layers, num_heads=heads, num_kv_heads=kv, head_dim=128, rms_norm_eps=1e-6,
      rope_theta=theta, max_position_embeddings=max_pos, tie_word_embeddings=tie, qk_norm=True,
      bos_token_id=151643, eos_token_id=eos)


# Published dimensions (the models' config.json on the Hugging Face hub).
PRESETS: dict[str, ModelConfig] = {
    "qwen2.5-7b": ModelConfig(
        family="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
        num_layers=28, num_heads=28, num_kv_heads=4, head_dim=128, rms_norm_eps=1e-6,
        rope_theta=1_000_000.0, max_position_embeddings=131072, tie_word_embeddings=False,
        qkv_bias=True, bos_token_id=151643, eos_token_id=151643),
    "qwen3-4b-base": _qwen3(151936, 2560, 9728, 36, 32, 8, 1_000_000.0, 32768, True, 151643),
    "qwen3-0.6b": _qwen3(151936, 1024, 3072, 28, 16, 8, 1_000_000.0, 40960, True, 151645),
    "qwen3-1.7b": _qwen3(151936, 2048, 6144, 28, 16, 8, 1_000_000.0, 40960, True, 151645),
    "qwen3-4b-instruct-2507": _qwen3(151936, 2560, 9728, 36, 32, 8, 5_000_000.0, 262144, True,
                                     151645),
    "llama-3-8b": ModelConfig(
        family="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5,
        rope_theta=500_000.0, max_position_embeddings=8192, tie_word_embeddings=False,
        bos_token_id=128000, eos_token_id=128001),
    "llama-3.1-8b": ModelConfig(
        family="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5,
        rope_theta=500_000.0,
        rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 8192),
        max_position_embeddings=131072, tie_word_embeddings=False,
        bos_token_id=128000, eos_token_id=128001),
}


def get_preset(name: str) -> ModelConfig:
  """The preset called `name` (see `PRESETS`)."""
  if name not in PRESETS:
    raise ValueError(f"unknown model preset {name!r}; known: {sorted(PRESETS)}")
  return PRESETS[name]
