"""Generic Flax NNX decoder covering Qwen2/2.5, Qwen3 and Llama-3 (dense) models.

The L decoder layers are stored stacked (each layer parameter has a leading `[L]` axis, matching the
`[L, B, S, K, H]` KV cache). They run either as `jax.lax.scan` over that axis (compile time flat in
depth) or as a Python loop of L layer calls on static slices (`layer_loop`). On CPU the loop is
the cheaper one to differentiate: XLA:CPU runs the scan's backward as while loops whose bodies
read and write per-layer residual stacks through dynamic slices (on the TRL peer's 2-layer model,
forward+backward of the log-probs: 496 thunks and 2,495 HLO instructions with the scan, 269 and
2,341 with the loop, 15-17% less CPU time; `benchmarks/profile_train_step.py`).
Parameters carry logical axis names in their `logical_axes` metadata; `disa_jax.parallel` maps them
onto a mesh. Activations are constrained through the same logical names when a `ShardingContext`
is attached (`model.sharding`); model code never names mesh axes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from disa_jax import config as config_lib
from disa_jax.models import attention as A
from disa_jax.models import attention_dispatch
from disa_jax.models import decode_attention as D
from disa_jax.models import layers as L
from disa_jax.models.config import ModelConfig
from disa_jax.parallel.rules import ShardingContext

# Parameter name -> (shape as a function of the config, logical axes). Layer parameters get a
# leading 'layers' axis of size num_layers.
_INIT_STD = 0.02
_LAYER_LOOPS = ("auto", "scan", "unrolled")
# Activations a rematerialised layer can keep (`jax.ad_checkpoint.checkpoint_name` in `_layer`; the
# fused attention kernels name their log-sum-exp 'attn_lse').
ATTN_NAMES = ("attn_q", "attn_k", "attn_v", "attn_out", "attn_lse")
MLP_NAMES = ("mlp_gate", "mlp_up")
_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "save_attn": jax.checkpoint_policies.save_only_these_names(*ATTN_NAMES[3:]),
    "save_qkv_attn": jax.checkpoint_policies.save_only_these_names(*ATTN_NAMES),
    "save_qkv_attn_mlp": jax.checkpoint_policies.save_only_these_names(*ATTN_NAMES, *MLP_NAMES),
}


def remat_policy(name: str):
  """The `jax.checkpoint` policy called ``name`` (`disa_jax.config.REMAT_POLICIES`):

  - 'full': nothing (each layer's input only; the backward reruns the whole layer);
  - 'save_attn': the attention output and the fused kernels' log-sum-exp: the backward reruns the
    norms, projections and MLP but not a fused attention's forward (its q, k, v come from the
    recomputed projections);
  - 'save_qkv_attn': also q, k, v (after RoPE): the q/k/v projections are not rerun either;
  - 'save_qkv_attn_mlp': also the MLP's gate and up projections (the backward reruns norms and
    elementwise ops only).
  'xla' / 'dense' attention keeps its probabilities in its own residuals, which every policy
  recomputes. JAX's `dots_with_no_batch_dims_saveable` is not offered: the projections are
  custom-VJP functions (`layers.dense`) whose matmuls it does not see, so it saved what 'full'
  saves (benchmarks/plan_memory.py: the same memory).
  """
  config_lib.check_remat_policy(name)
  return _POLICIES[name]


def layer_param_specs(c: ModelConfig) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
  """Per-layer parameter shapes (without the leading L axis) and logical axes for config `c`."""
  d, f, n, k, h = c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim
  specs = {
      "attn_norm": ((d,), ("norm",)),
      "q_kernel": ((d, n, h), ("embed", "q_heads", "head_dim")),
      "k_kernel": ((d, k, h), ("embed", "kv_heads", "head_dim")),
      "v_kernel": ((d, k, h), ("embed", "kv_heads", "head_dim")),
      "o_kernel": ((n, h, d), ("q_heads", "head_dim", "embed")),
      "mlp_norm": ((d,), ("norm",)),
      "gate_kernel": ((d, f), ("embed", "mlp")),
      "up_kernel": ((d, f), ("embed", "mlp")),
      "down_kernel": ((f, d), ("mlp", "embed")),
  }
  if c.qkv_bias:
    specs["q_bias"] = ((n, h), ("q_heads", "head_dim"))
    specs["k_bias"] = ((k, h), ("kv_heads", "head_dim"))
    specs["v_bias"] = ((k, h), ("kv_heads", "head_dim"))
  if c.o_bias:
    specs["o_bias"] = ((d,), ("norm",))
  if c.qk_norm:
    specs["q_norm"] = ((h,), ("norm",))
    specs["k_norm"] = ((h,), ("norm",))
  return specs


class DecoderLayers(nnx.Module):
  """The L decoder layers' parameters, stacked on a leading `[L]` axis."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, param_dtype: Any = jnp.float32):
    self.names = tuple(sorted(layer_param_specs(config)))
    for name, (shape, axes) in layer_param_specs(config).items():
      full = (config.num_layers,) + shape
      if name.endswith("norm"):
        value = jnp.ones(full, param_dtype)
      elif name.endswith("bias"):
        value = jnp.zeros(full, param_dtype)
      else:
        value = _INIT_STD * jax.random.normal(rngs.params(), full, param_dtype)
      setattr(self, name, nnx.Param(value, logical_axes=("layers",) + axes))

  def stacked(self) -> dict[str, jax.Array]:
    """The parameters as a dict of `[L, ...]` arrays."""
    return {name: getattr(self, name)[...] for name in self.names}


@dataclasses.dataclass(frozen=True)
class ModelOptions:
  """The runtime choices of a `Transformer`: none changes its parameters or, but for the bounds,
  its outputs (each option is tested against the reference path it replaces).

  Attributes:
    remat: recompute each layer's activations in the backward pass (`jax.checkpoint`).
    remat_policy: with remat, what each layer keeps (`remat_policy`; default 'full': nothing).
    scan_unroll: `unroll` of the scan over layers (1 = rolled loop; num_layers = fully unrolled);
      used only when the layers run as a scan.
    attention_chunk: 0 = no chunking; c > 0 = the 'xla' / 'dense' attention runs its queries in
      blocks of c whose probabilities the backward pass recomputes ('xla': a custom VJP,
      `attention_xla`; 'dense': `jax.checkpoint` per chunk): `[B, N, c, keys]` scores at a time,
      for long packed rows (any T). The fused implementations ignore it.
    attention_impl: which attention runs the packed rows (`attention_dispatch`; 'auto' = 'dense'
      for rows of <= 256 tokens and 'xla' for longer ones on a CPU, 'cudnn' on a GPU, 'splash' on
      a TPU). The KV-cache path is always the dense one.
    max_segment_len: the longest segment (packed sequence) a row can hold; 0 = the row length. The
      'xla' attention skips keys further back (a band); a row that breaks the bound gets NaN.
    max_segments: the most segments a packed row can hold; 'cudnn' needs it (>= 1: its segment
      slots; 0 is refused there), the other implementations ignore it.
    layer_loop: how the layers run: 'scan' (`jax.lax.scan`), 'unrolled' (a Python loop: no
      per-layer residual stacks, compile time grows with depth), or 'auto' ('unrolled' when the
      default JAX backend is CPU, where it is the faster one, else 'scan').
    decode_attention: the sampler's ragged decode attention (`decode_ragged`): 'xla' (the
      reference loop over every block of the cache, `decode_attention`: no host round trip on a
      GPU), 'xla_live' (over the live blocks only: data-dependent loop bounds), 'pallas' (one
      kernel, `decode_attention_pallas`, for every layer), or 'auto' ('xla_live' when the model
      compiles for a CPU and its cache has more than `decode_attention.CPU_STATIC_BLOCKS`
      blocks, else 'xla').
  """
  remat: bool = False
  remat_policy: str = "full"
  scan_unroll: int = 1
  layer_loop: str = "auto"
  attention_chunk: int = 0
  attention_impl: str = "auto"
  max_segment_len: int = 0
  max_segments: int = 0
  decode_attention: str = "auto"

  def __post_init__(self):
    if self.layer_loop not in _LAYER_LOOPS:
      raise ValueError(f"Transformer layer_loop={self.layer_loop!r}; expected one of "
                       f"{_LAYER_LOOPS}")
    config_lib.check_attention_chunk(self.attention_chunk, "Transformer attention_chunk")
    config_lib.check_attention_impl(self.attention_impl, "Transformer attention_impl")
    config_lib.check_remat_policy(self.remat_policy, "Transformer remat_policy")
    config_lib.check_count(self.max_segment_len, "Transformer max_segment_len", "0 = no bound")
    config_lib.check_count(self.max_segments, "Transformer max_segments", "0 = no bound")
    if self.decode_attention not in D.IMPLS:
      raise ValueError(f"Transformer decode_attention must be one of {D.IMPLS}, got "
                       f"{self.decode_attention!r}")


class Transformer(nnx.Module):
  """Decoder-only language model (see module docstring).

  Args:
    config: the architecture.
    rngs: parameter initialisation RNGs (`rngs.params()`).
    dtype: computation dtype of activations (logits are returned in it).
    param_dtype: storage dtype of parameters.
    options: the runtime choices (`ModelOptions`: remat, layer loop, attention implementation and
      bounds).
  """

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, dtype: Any = jnp.float32,
               param_dtype: Any = jnp.float32, options: ModelOptions = ModelOptions()):
    self.config = config
    self.dtype = dtype
    self.param_dtype = param_dtype
    self.options = options
    self.sharding: ShardingContext | None = None
    v, d = config.vocab_size, config.hidden_size
    self.embed = nnx.Param(_INIT_STD * jax.random.normal(rngs.params(), (v, d), param_dtype),
                           logical_axes=("vocab", "embed"))
    self.layers = DecoderLayers(config, rngs=rngs, param_dtype=param_dtype)
    self.final_norm = nnx.Param(jnp.ones((d,), param_dtype), logical_axes=("norm",))
    if config.tie_word_embeddings:
      self.lm_head = None
    else:
      self.lm_head = nnx.Param(_INIT_STD * jax.random.normal(rngs.params(), (d, v), param_dtype),
                               logical_axes=("embed", "vocab"))

  # ----------------------------------------------------------------------------------------------
  # helpers
  # ----------------------------------------------------------------------------------------------

  def _constrain(self, x: jax.Array, axes: tuple[str | None, ...]) -> jax.Array:
    if self.sharding is None:
      return x
    return self.sharding.constrain(x, axes)

  def lm_head_kernel(self) -> jax.Array:
    """The output projection `[D, V]` (the embedding transposed when tied), in param dtype."""
    if self.lm_head is None:
      return self.embed[...].T
    return self.lm_head[...]

  def _embed(self, input_ids: jax.Array) -> jax.Array:
    with jax.named_scope("embed"):
      x = jnp.take(self.embed[...], input_ids, axis=0).astype(self.dtype)
      return self._constrain(x, ("batch", "seq", "act_embed"))

  def _layer(self, p: dict[str, jax.Array], x: jax.Array, cos: jax.Array, sin: jax.Array,
             mask: jax.Array, kv: tuple[jax.Array, jax.Array] | None,
             cache_index: jax.Array | None, layer: int | None = None):
    """One decoder layer. x `[B, T, D]`.

    kv: this layer's cache `([B, S, K, H], [B, S, K, H])`, or with `layer` the whole cache
    `([L, B, S, K, H], ...)`, of which slice `layer` is this layer's (the new entries are written
    into it in place), or the sampler's head-major `decode_attention.RaggedKV` (with `layer`).
    Returns (x, the updated kv).
    """
    c = self.config
    p = {name: a.astype(self.dtype) for name, a in p.items()}
    with jax.named_scope("attention"):  # names the ops in profiles
      h = L.rms_norm(x, p["attn_norm"], c.rms_norm_eps)
      q = L.dense(h, p["q_kernel"])
      k = L.dense(h, p["k_kernel"])
      v = L.dense(h, p["v_kernel"])
      if c.qkv_bias:
        q, k, v = q + p["q_bias"], k + p["k_bias"], v + p["v_bias"]
      if c.qk_norm:
        q = L.rms_norm(q, p["q_norm"], c.rms_norm_eps)
        k = L.rms_norm(k, p["k_norm"], c.rms_norm_eps)
      q = self._constrain(L.apply_rope(q, cos, sin), ("batch", "seq", "act_heads", None))
      k = self._constrain(L.apply_rope(k, cos, sin), ("batch", "seq", "act_kv_heads", None))
      v = self._constrain(v, ("batch", "seq", "act_kv_heads", None))
      q, k, v = (checkpoint_name(a, name) for a, name in zip((q, k, v), ATTN_NAMES))
      new_kv = None
      if kv is not None and not isinstance(kv, D.RaggedKV):
        k_cache, v_cache = kv
        if layer is None:
          start = (0, cache_index, 0, 0)
          k_cache = jax.lax.dynamic_update_slice(k_cache, k.astype(k_cache.dtype), start)
          v_cache = jax.lax.dynamic_update_slice(v_cache, v.astype(v_cache.dtype), start)
          k, v = k_cache.astype(self.dtype), v_cache.astype(self.dtype)
        else:
          start = (layer, 0, cache_index, 0, 0)
          k_cache = jax.lax.dynamic_update_slice(k_cache, k.astype(k_cache.dtype)[None], start)
          v_cache = jax.lax.dynamic_update_slice(v_cache, v.astype(v_cache.dtype)[None], start)
          k, v = k_cache[layer].astype(self.dtype), v_cache[layer].astype(self.dtype)
        new_kv = (k_cache, v_cache)
      if isinstance(kv, D.RaggedKV):  # writes this layer's entries, attends over the live ones
        impl = D.resolve(self.options.decode_attention, self._backend(),
                         kv.k.shape[3] // kv.block)
        attn, new_kv = kv.update_and_attend(q, k, v, layer, impl)
      else:
        chunk = self.options.attention_chunk
        attn = (A.gqa_attention(q, k, v, mask, query_chunk=chunk)  # cache: a mask
                if kv is not None else self._attention(q, k, v, mask))  # rows: their layout
      attn = checkpoint_name(attn, "attn_out")
      out = L.dense(attn, p["o_kernel"], 2)
      if c.o_bias:
        out = out + p["o_bias"]
      x = self._constrain(x + out, ("batch", "seq", "act_embed"))
    with jax.named_scope("mlp"):
      h = L.rms_norm(x, p["mlp_norm"], c.rms_norm_eps)
      g = self._constrain(L.dense(h, p["gate_kernel"]), ("batch", "seq", "act_mlp"))
      u = self._constrain(L.dense(h, p["up_kernel"]), ("batch", "seq", "act_mlp"))
      g, u = checkpoint_name(g, MLP_NAMES[0]), checkpoint_name(u, MLP_NAMES[1])
      x = x + L.dense(jax.nn.silu(g) * u, p["down_kernel"])
      x = self._constrain(x, ("batch", "seq", "act_embed"))
    return x, new_kv

  def _device(self) -> Any:
    """A device the model's programs compile for: its mesh's when a mesh is attached (e.g. the
    abstract GPUs of `parallel.gpu_compile`, compiled on a CPU), else JAX's first device."""
    if self.sharding is not None:
      return self.sharding.mesh.devices.flat[0]
    return jax.devices()[0]

  def _backend(self) -> str:
    return self._device().platform

  def _layers_unrolled(self) -> bool:
    if self.options.layer_loop == "auto":
      return self._backend() == "cpu"
    return self.options.layer_loop == "unrolled"

  def _run(self, input_ids: jax.Array, positions: jax.Array,
           mask: jax.Array | A.SegmentLayout, *,
           cache: dict[str, jax.Array] | None = None, cache_index: jax.Array | None = None,
           collect: bool = False):
    """Embeds, runs the layers; returns (pre-norm x `[B,T,D]`, per-layer outputs | None, cache).

    ``mask``: the rows' `attention.SegmentLayout` (no cache), or the `[B, T, S]` mask of the cache.
    """
    x = self._embed(input_ids)
    c = self.config
    cos, sin = L.rope_cos_sin(positions, L.rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling))
    stacked = self.layers.stacked()

    def layer(x, p, kv, i=None):
      return self._layer(p, x, cos, sin, mask, kv, cache_index, i)

    if self.options.remat:
      layer = jax.checkpoint(layer, policy=remat_policy(self.options.remat_policy),
                             static_argnums=(3,))
    kv_xs = None if cache is None else (cache["k"], cache["v"])
    if self._layers_unrolled():
      outs = []
      for i in range(c.num_layers):  # the whole cache is threaded through, written in place
        x, kv_xs = layer(x, {name: a[i] for name, a in stacked.items()}, kv_xs, i)
        outs.append(x)
      per_layer = jnp.stack(outs) if collect else None
      new_cache = None if cache is None else {"k": kv_xs[0], "v": kv_xs[1]}
      return x, per_layer, new_cache

    def body(x, xs):
      p, kv = xs
      y, new_kv = layer(x, p, kv, None)
      return y, (new_kv, y if collect else None)

    x, (new_kv, per_layer) = jax.lax.scan(body, x, (stacked, kv_xs),
                                          unroll=self.options.scan_unroll)
    new_cache = None if cache is None else {"k": new_kv[0], "v": new_kv[1]}
    return x, per_layer, new_cache

  @staticmethod
  def _default_positions(input_ids: jax.Array, attention_mask: jax.Array | None,
                         segment_ids: jax.Array | None = None) -> jax.Array:
    if segment_ids is not None:
      return L.segment_positions(segment_ids)
    if attention_mask is None:
      return jnp.broadcast_to(jnp.arange(input_ids.shape[1], dtype=jnp.int32), input_ids.shape)
    return jnp.maximum(jnp.cumsum(attention_mask.astype(jnp.int32), axis=1) - 1, 0)

  def _layout(self, input_ids: jax.Array, attention_mask: jax.Array | None,
              segment_ids: jax.Array | None = None,
              branch_ids: jax.Array | None = None) -> A.SegmentLayout:
    """The rows' `attention.SegmentLayout`: causal within ``segment_ids`` (0 = padding), with
    ``branch_ids`` (shared prompts) also the key's branch 0 (the prompt) or the query's own; an
    ``attention_mask`` is one segment of its real tokens (padding rows attend to nothing); neither
    is one segment of the whole row."""
    b, t = input_ids.shape
    if branch_ids is not None and segment_ids is None:
      raise ValueError("branch_ids (shared prompts) need segment_ids, got None")
    if segment_ids is not None and attention_mask is not None:
      raise ValueError("pass attention_mask or segment_ids, not both (segment 0 is padding)")
    for name, ids in (("segment_ids", segment_ids), ("branch_ids", branch_ids),
                      ("attention_mask", attention_mask)):
      if ids is not None and ids.shape != (b, t):
        raise ValueError(f"{name} must be [B, T] = {(b, t)}, got {ids.shape}")
    if segment_ids is None:
      real = jnp.ones((b, t), bool) if attention_mask is None else attention_mask.astype(bool)
      segment_ids = real.astype(jnp.int32)
    layout = A.packed_layout(segment_ids, branch_ids)
    span = A.segment_span(layout) if self.options.max_segment_len else None
    if span is not None and not isinstance(span, jax.core.Tracer):  # eager: refuse at once
      longest = np.asarray(span).max(axis=1)
      over = np.flatnonzero(longest > self.options.max_segment_len)
      if over.size:
        raise ValueError(f"Transformer max_segment_len={self.options.max_segment_len}: row "
                         f"{over[0]} holds a segment of {longest[over[0]]} tokens")
    return layout

  def _full_mask(self, input_ids: jax.Array, attention_mask: jax.Array | None,
                 segment_ids: jax.Array | None = None,
                 branch_ids: jax.Array | None = None) -> jax.Array:
    """`[B, T, T]` bool: the dense mask of `_layout` (the reference; tests)."""
    return A.dense_mask(self._layout(input_ids, attention_mask, segment_ids, branch_ids))

  def _attention(self, q: jax.Array, k: jax.Array, v: jax.Array, layout: A.SegmentLayout
                 ) -> jax.Array:
    """Self-attention over packed rows by `attention_impl` (`attention_dispatch`)."""
    o = self.options
    impl = attention_dispatch.resolve_impl(
        o.attention_impl, backend=self._backend(), dtype=q.dtype, head_dim=q.shape[-1],
        branches=layout.branch_ids is not None,
        capability=getattr(self._device(), "compute_capability", None), row_len=q.shape[1])
    return attention_dispatch.attend(q, k, v, layout, impl=impl, chunk=o.attention_chunk,
                                     window=o.max_segment_len, max_segments=o.max_segments,
                                     sharding=self.sharding)

  def _check_ids(self, input_ids: jax.Array) -> None:
    if input_ids.ndim != 2:
      raise ValueError(f"input_ids must be [B, T], got shape {input_ids.shape}")

  # ----------------------------------------------------------------------------------------------
  # public API
  # ----------------------------------------------------------------------------------------------

  def _prepare(self, input_ids, positions, attention_mask, segment_ids, branch_ids=None):
    """Checks the ids; returns (positions `[B, T]`, the rows' `attention.SegmentLayout`)."""
    self._check_ids(input_ids)
    mask = self._layout(input_ids, attention_mask, segment_ids, branch_ids)
    if positions is None and branch_ids is not None:
      raise ValueError("branch_ids (shared prompts) need explicit positions (each response "
                       "continues from its prompt), got positions=None")
    if positions is None:
      positions = self._default_positions(input_ids, attention_mask, segment_ids)
    return positions, mask

  def hidden_states(self, input_ids: jax.Array, *, positions: jax.Array | None = None,
                    attention_mask: jax.Array | None = None,
                    segment_ids: jax.Array | None = None,
                    branch_ids: jax.Array | None = None) -> jax.Array:
    """Final-normed hidden states.

    Args:
      input_ids: `[B, T]` int token ids.
      positions: `[B, T]` int RoPE positions; default: restarting at 0 in each segment with
        ``segment_ids``, else cumsum(attention_mask) - 1 clipped at 0.
      attention_mask: `[B, T]` (1 = real token, 0 = pad); default all ones.
      segment_ids: `[B, T]` int (packed rows: 0 = padding, k = the k-th sequence of the row);
        a token attends causally to the tokens of its own segment only. Exclusive with
        ``attention_mask``.
      branch_ids: `[B, T]` int, shared prompts (`disa_jax.data.packing`, needs ``segment_ids`` and
        ``positions``): 0 on a segment's prompt, k on its k-th response; a token attends to the
        prompt and its own branch only.

    Returns:
      `[B, T, D]` in the computation dtype.
    """
    positions, mask = self._prepare(input_ids, positions, attention_mask, segment_ids, branch_ids)
    x, _, _ = self._run(input_ids, positions, mask)
    return L.rms_norm(x, self.final_norm[...], self.config.rms_norm_eps)

  def layer_outputs(self, input_ids: jax.Array, *, positions: jax.Array | None = None,
                    attention_mask: jax.Array | None = None,
                    segment_ids: jax.Array | None = None) -> jax.Array:
    """Residual stream after the embedding and after each layer (before the final norm).

    Args: as `hidden_states`.

    Returns:
      `[L + 1, B, T, D]`: index 0 = embeddings, index i = output of layer i.
    """
    positions, mask = self._prepare(input_ids, positions, attention_mask, segment_ids)
    x0 = self._embed(input_ids)
    _, per_layer, _ = self._run(input_ids, positions, mask, collect=True)
    return jnp.concatenate([x0[None], per_layer], axis=0)

  def logits_from_hidden(self, hidden: jax.Array) -> jax.Array:
    """`[..., D]` final-normed hidden -> `[..., V]` logits in the computation dtype."""
    logits = jnp.einsum("...d,dv->...v", hidden, self.lm_head_kernel().astype(self.dtype))
    return logits

  def __call__(self, input_ids: jax.Array, *, positions: jax.Array | None = None,
               attention_mask: jax.Array | None = None, segment_ids: jax.Array | None = None,
               branch_ids: jax.Array | None = None, return_hidden: bool = False):
    """Logits of every position.

    Args:
      input_ids: `[B, T]` int token ids.
      positions: `[B, T]` int positions (default: see `hidden_states`).
      attention_mask: `[B, T]` (1 = real, 0 = pad); causal + key-padding masking.
      segment_ids: `[B, T]` int packed-row segments (0 = padding); causal within a segment.
      branch_ids: `[B, T]` int shared-prompt branches (see `hidden_states`).
      return_hidden: also return the final-normed hidden states.

    Returns:
      logits `[B, T, V]`, or `(logits, hidden [B, T, D])` with return_hidden.
    """
    hidden = self.hidden_states(input_ids, positions=positions, attention_mask=attention_mask,
                                segment_ids=segment_ids, branch_ids=branch_ids)
    logits = self._constrain(self.logits_from_hidden(hidden), ("batch", "seq", "act_vocab"))
    return (logits, hidden) if return_hidden else logits

  def init_cache(self, batch_size: int, max_len: int, dtype: Any = jnp.float32
                 ) -> dict[str, jax.Array]:
    """An empty KV cache: `{'k': [L, B, S, K, H], 'v': [L, B, S, K, H]}` zeros, S = max_len."""
    c = self.config
    shape = (c.num_layers, batch_size, max_len, c.num_kv_heads, c.head_dim)
    return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}

  def forward_with_cache(self, input_ids: jax.Array, positions: jax.Array,
                         cache: dict[str, jax.Array], cache_index: jax.Array, kv_mask: jax.Array,
                         *, last_only: bool = False):
    """Incremental forward through the KV cache (prefill or decode).

    Args:
      input_ids: `[B, T]` new tokens, written to slots `[cache_index, cache_index + T)`.
      positions: `[B, T]` their RoPE positions.
      cache: from `init_cache` (`[L, B, S, K, H]` k and v).
      cache_index: int32 scalar (may be traced), the slot of `input_ids[:, 0]`.
      kv_mask: `[B, S]` bool, True where a slot holds a real token (new tokens included).
      last_only: compute the logits of the last position only (`[B, 1, V]`: all a prefill before
        sampling needs; skips the vocabulary projection of the other T - 1 positions).

    Returns:
      (logits `[B, T, V]`, updated cache). Query at slot i attends to slots j <= i with kv_mask.
    """
    self._check_ids(input_ids)
    t = input_ids.shape[1]
    s = cache["k"].shape[2]
    cache_index = jnp.asarray(cache_index, jnp.int32)
    q_slot = cache_index + jnp.arange(t, dtype=jnp.int32)  # [T]
    causal = jnp.arange(s, dtype=jnp.int32)[None, :] <= q_slot[:, None]  # [T, S]
    mask = causal[None] & kv_mask.astype(bool)[:, None, :]  # [B, T, S]
    x, _, new_cache = self._run(input_ids, positions, mask, cache=cache, cache_index=cache_index)
    if last_only:
      x = x[:, -1:]
    hidden = L.rms_norm(x, self.final_norm[...], self.config.rms_norm_eps)
    return self.logits_from_hidden(hidden), new_cache

  def decode_ragged(self, input_ids: jax.Array, positions: jax.Array, cache: D.RaggedKV
                    ) -> tuple[jax.Array, D.RaggedKV]:
    """One decode step through the sampler's ragged head-major cache (`decode_attention`).

    Args:
      input_ids: `[B, 1]` each slot's new token, written at ``cache.write``.
      positions: `[B, 1]` their RoPE positions.
      cache: the `decode_attention.RaggedKV` (each slot attends over ``[start, write]``).

    Returns:
      (logits `[B, 1, V]`, the cache with the new entries, updated in place).
    """
    self._check_ids(input_ids)
    x = self._embed(input_ids)
    c = self.config
    cos, sin = L.rope_cos_sin(positions, L.rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling))

    def layer(x, p, kv, i):
      return self._layer(p, x, cos, sin, None, kv, None, i)

    x, cache = D.run_layers(layer, x, self.layers.stacked(), cache,
                            unrolled=self._layers_unrolled())
    hidden = L.rms_norm(x, self.final_norm[...], c.rms_norm_eps)
    return self.logits_from_hidden(hidden), cache
