"""Low-rank adapters (LoRA) on the stacked decoder-layer projections, and their merge.

For a target kernel W of shape ``[L, *in, *out]`` (the layer axis L first, e.g. q: ``[L, D, N, H]``
with in = (D,), out = (N, H); o: ``[L, N, H, D]`` with in = (N, H), out = (D,)), the adapted kernel is

    W' = W + (alpha / r) * A B,   A: [L, *in, r],  B: [L, r, *out],

where A B contracts the rank axis (flattening in and out). B starts at zero, so the adapted model
equals the base model until B is trained. A and B are `LoRAParam` variables (flax's
``nnx.LoRAParam``, a subclass of ``nnx.Param``): ``nnx.split(model, LoRAParam, ...)`` and
``make_sft_step(cfg, graphdef)`` train only them, while a full-parameter filter (``nnx.Param``)
still sees everything.

`apply_lora` swaps the model's `DecoderLayers` for `LoRADecoderLayers`, which shares the base
variables and returns the adapted kernels from ``stacked()`` (the method the decoder's layer scan
reads), so the forward pass, the KV-cache path and the scorer need no change. The adapted kernels
are materialised once per forward (one extra copy of the targeted weights, in the compute dtype).
`merge_lora` returns a plain `Transformer` with W' folded in, ready for ``save_pretrained``.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from disa_jax.models import Transformer
from disa_jax.models.transformer import DecoderLayers

LoRAParam = nnx.LoRAParam

# Target kernel -> number of input axes after the layer axis.
KERNEL_IN_AXES = {"q_kernel": 1, "k_kernel": 1, "v_kernel": 1, "o_kernel": 2,
                  "gate_kernel": 1, "up_kernel": 1, "down_kernel": 1}
ALL_TARGETS = tuple(KERNEL_IN_AXES)


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
  """Adapter shape.

  Attributes:
    rank: r, the adapter rank (App. D.4: 64).
    alpha: the scale numerator; the update is (alpha / r) A B. The paper does not state it; 2r
      (128 at r = 64) is the common choice.
    targets: the layer kernels that get adapters (default: all attention and MLP projections).
  """
  rank: int = 64
  alpha: float = 128.0
  targets: tuple[str, ...] = ALL_TARGETS

  def __post_init__(self):
    if self.rank < 1:
      raise ValueError(f"LoRAConfig.rank must be >= 1, got {self.rank!r}")
    if not self.alpha > 0:
      raise ValueError(f"LoRAConfig.alpha must be > 0, got {self.alpha!r}")
    bad = [t for t in self.targets if t not in KERNEL_IN_AXES]
    if bad or not self.targets:
      raise ValueError(f"LoRAConfig.targets must be a non-empty subset of {ALL_TARGETS}, "
                       f"got {self.targets!r}")

  @property
  def scale(self) -> float:
    return self.alpha / self.rank


def lora_delta(a: jax.Array, b: jax.Array, num_in_axes: int) -> jax.Array:
  """A B for stacked adapters.

  Args:
    a: ``[L, *in, r]``.
    b: ``[L, r, *out]``.
    num_in_axes: len(in).

  Returns:
    ``[L, *in, *out]`` float32.
  """
  n_layers, rank = a.shape[0], a.shape[-1]
  in_shape, out_shape = a.shape[1:1 + num_in_axes], b.shape[2:]
  a2 = a.astype(jnp.float32).reshape(n_layers, math.prod(in_shape), rank)  # [L, *in, r] -> [L, I, r]
  b2 = b.astype(jnp.float32).reshape(n_layers, rank, math.prod(out_shape))  # [L, r, *out] -> [L, r, O]
  delta = jnp.einsum("lir,lro->lio", a2, b2)
  return delta.reshape((n_layers,) + tuple(in_shape) + tuple(out_shape))  # [L, I, O] -> [L, *in, *out]


class LoRADecoderLayers(DecoderLayers):
  """`DecoderLayers` whose ``stacked()`` returns W + (alpha / r) A B for the targeted kernels.

  Shares the base layer variables (no copy); adds ``<kernel>_lora_a`` / ``<kernel>_lora_b``
  `LoRAParam` variables in float32.

  Args:
    base: the model's decoder layers.
    config: adapter settings.
    rngs: initialises A (normal, std 1 / sqrt(prod(in))).
  """

  def __init__(self, base: DecoderLayers, config: LoRAConfig, *, rngs: nnx.Rngs):  # pylint: disable=super-init-not-called
    self.names = base.names
    for name in base.names:
      setattr(self, name, getattr(base, name))
    self.lora_rank = config.rank
    self.lora_scale = config.scale
    self.lora_targets = tuple(config.targets)
    for name in self.lora_targets:
      var = getattr(base, name)
      shape = var[...].shape
      axes = var.get_metadata()["logical_axes"]
      n_in = KERNEL_IN_AXES[name]
      in_shape, out_shape = shape[1:1 + n_in], shape[1 + n_in:]
      std = 1.0 / math.sqrt(math.prod(in_shape))
      a = std * jax.random.normal(rngs.params(), (shape[0],) + in_shape + (config.rank,),
                                  jnp.float32)
      b = jnp.zeros((shape[0], config.rank) + out_shape, jnp.float32)
      setattr(self, f"{name}_lora_a",
              LoRAParam(a, logical_axes=tuple(axes[:1 + n_in]) + (None,)))
      setattr(self, f"{name}_lora_b",
              LoRAParam(b, logical_axes=(axes[0], None) + tuple(axes[1 + n_in:])))

  def delta(self, name: str) -> jax.Array:
    """(alpha / r) A B of kernel ``name``, ``[L, ...]`` float32."""
    a = getattr(self, f"{name}_lora_a")[...]
    b = getattr(self, f"{name}_lora_b")[...]
    return self.lora_scale * lora_delta(a, b, KERNEL_IN_AXES[name])

  def stacked(self) -> dict[str, jax.Array]:
    """The adapted layer parameters as ``[L, ...]`` arrays (targets in float32 + base dtype)."""
    out = {name: getattr(self, name)[...] for name in self.names}
    for name in self.lora_targets:
      base = out[name]
      out[name] = (base.astype(jnp.float32) + self.delta(name)).astype(base.dtype)
    return out


def apply_lora(model: Transformer, config: LoRAConfig, *, seed: int = 0) -> Transformer:
  """Adds adapters to ``model`` in place and returns it.

  Args:
    model: a `Transformer` without adapters.
    config: adapter settings.
    seed: initialisation seed of the A matrices.
  """
  if isinstance(model.layers, LoRADecoderLayers):
    raise ValueError("apply_lora: the model already has LoRA adapters")
  model.layers = LoRADecoderLayers(model.layers, config, rngs=nnx.Rngs(seed))
  return model


def has_lora(model: Transformer) -> bool:
  return isinstance(model.layers, LoRADecoderLayers)


def lora_param_count(model: Transformer) -> int:
  """Number of adapter scalars."""
  return sum(x.size for x in jax.tree.leaves(nnx.state(model, LoRAParam)))


def merge_lora(model: Transformer) -> Transformer:
  """A plain `Transformer` with the adapters folded into the base weights (``W' = W + s A B``).

  The merged kernels are computed exactly as the adapted forward computes them, so the merged
  model's logits equal the adapted model's. Parameters keep their dtype (and device placement).

  Args:
    model: a model with adapters (`apply_lora`).

  Returns:
    A new model without adapters; ``model`` is unchanged.
  """
  if not has_lora(model):
    raise ValueError("merge_lora: the model has no LoRA adapters")
  merged = nnx.eval_shape(lambda: Transformer(model.config, rngs=nnx.Rngs(0), dtype=model.dtype,
                                              param_dtype=model.param_dtype,
                                              options=model.options))
  merged.embed.set_value(model.embed[...])
  merged.final_norm.set_value(model.final_norm[...])
  if model.lm_head is not None:
    merged.lm_head.set_value(model.lm_head[...])
  layers = model.layers.stacked()
  for name in merged.layers.names:
    getattr(merged.layers, name).set_value(layers[name])
  merged.sharding = model.sharding
  return merged


def lora_state_dict(model: Transformer) -> dict[str, Any]:
  """The adapters as a nested pure dict (for checkpoints)."""
  return nnx.to_pure_dict(nnx.state(model, LoRAParam))
