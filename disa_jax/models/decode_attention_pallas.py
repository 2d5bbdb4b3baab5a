"""Ragged decode attention as one Pallas kernel (``decode_attention='pallas'``).

The same computation as `decode_attention.ragged_attention` (the XLA reference every backend
runs): one query per slot attends over the slot's live cache entries ``[start, write]`` of a
head-major cache `[L, B, K, S, H]` held as the bits of its values, with an online softmax over
blocks (float32 scores; probabilities cast to the values' dtype before the value product, as the
reference does). What differs is where the loop over blocks runs:

- the reference runs one XLA loop per layer over the blocks of the whole cache (or of every
  slot's live range), each iteration a handful of kernels over all B slots;
- here one kernel launch per layer runs a program per (slot, key/value head) that loops over its
  *own* live blocks on the device: a short row reads only its own blocks, and a layer costs one
  launch.

The new key and value of each slot are written first (`ragged_write`, an in-place scatter into the
cache, which is the caller's loop carry); the kernel only reads the cache. The layer is the
kernel's operand (a `[1]` int32), not part of its block map: each program's cache block spans the
L layers of its (slot, head) and it reads layer ``layer``'s rows, so the layers of a scanned stack
(`Transformer.decode_ragged`) run one compiled kernel. The kernel loops in blocks of
``KERNEL_BLOCK`` positions at most (its float32 `[G, block, H]` products are what Triton compiles:
seconds at 32 positions, minutes at 256).

Written for the Triton lowering (GPU; named in the call's compiler parameters, since JAX's default
GPU lowering for `pallas_call` is Mosaic GPU, which would copy each program's whole `[L, S, H]`
block into shared memory); on a CPU it runs in the Pallas interpreter (the tests, which compare it
with the reference). The G query heads of a key/value head are one program's `[G, H]` query
block; scores and the value product are broadcast products reduced in float32 (G is small, below
the 16 rows a Triton matrix product needs).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from disa_jax.models.attention import MASK_VALUE
from disa_jax.models.kv_bits import as_bits, from_bits

# The kernel's own loop block (positions): its `[G, block, H]` float32 products are what Triton
# compiles, ~2 s for an H100 at 32 and ~126 s at 256 (`tests/models/test_decode_compile.py`).
KERNEL_BLOCK = 32


def ragged_write(k: jax.Array, v: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                 layer: Any, write: jax.Array, dtype: Any) -> tuple[jax.Array, jax.Array]:
  """Writes each slot's new key and value at ``write`` of layer ``layer`` (in place).

  Args:
    k, v: `[B, K, H]` the new keys and values.
    k_cache, v_cache: `[L, B, K, S, H]` the cache, as bits of ``dtype`` values.
    layer: the layer index (int or traced int32 scalar).
    write: `[B]` int32 positions.
    dtype: the cache values' dtype.

  Returns:
    The two caches with the new entries.
  """
  rows = jnp.arange(k.shape[0])
  k_bits, v_bits = as_bits(k.astype(dtype)), as_bits(v.astype(dtype))
  return (k_cache.at[layer, rows, :, write, :].set(k_bits),
          v_cache.at[layer, rows, :, write, :].set(v_bits))


def _kernel(layer_ref, start_ref, end_ref, q_ref, k_ref, v_ref, o_ref, *, block: int,
            dtype: Any, scale: float):
  """One (slot b, key/value head) program: ``layer_ref`` `[1]` the layer, ``q_ref`` `[G, H]`,
  ``k_ref`` / ``v_ref`` `[L, S, H]` (the slot's cache of this head in every layer, bits; only
  layer ``layer_ref[0]``'s live blocks are read), ``o_ref`` `[G, H]`."""
  b = pl.program_id(0)
  layer = layer_ref[0]
  lo, hi = start_ref[b], end_ref[b]  # live entries [lo, hi)
  q = q_ref[...].astype(jnp.float32)  # [G, H]
  g, h = q.shape

  def body(i, carry):
    m, l, acc = carry  # [G], [G], [G, H]
    sl = pl.ds(i * block, block)
    kb = from_bits(k_ref[layer, sl, :], dtype).astype(q_ref.dtype).astype(jnp.float32)
    vb = from_bits(v_ref[layer, sl, :], dtype).astype(q_ref.dtype)  # [block, H]
    scores = jnp.sum(q[:, None, :] * kb[None, :, :], axis=-1) * scale  # [G, block]
    pos = i * block + lax.broadcasted_iota(jnp.int32, (g, block), 1)
    valid = (pos >= lo) & (pos < hi)
    scores = jnp.where(valid, scores, MASK_VALUE)
    m_new = jnp.maximum(m, jnp.max(scores, axis=-1))
    alpha = jnp.exp(m - m_new)
    p = jnp.where(valid, jnp.exp(scores - m_new[:, None]), 0.0)
    pv = jnp.sum(p.astype(vb.dtype).astype(jnp.float32)[:, :, None]
                 * vb.astype(jnp.float32)[None, :, :], axis=1)  # [G, H]
    return m_new, alpha * l + jnp.sum(p, axis=-1), alpha[:, None] * acc + pv

  init = (jnp.full((g,), MASK_VALUE, jnp.float32), jnp.zeros((g,), jnp.float32),
          jnp.zeros((g, h), jnp.float32))
  _, l, acc = lax.fori_loop(lax.div(lo, block), lax.div(hi + block - 1, block), body, init)
  o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)


def pallas_ragged_attention(q: jax.Array, k: jax.Array, v: jax.Array, k_cache: jax.Array,
                            v_cache: jax.Array, layer: Any, write: jax.Array, start: jax.Array,
                            block: int, dtype: str, interpret: bool | None = None
                            ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """`decode_attention.ragged_attention` with the loop over blocks in one Pallas kernel.

  Args:
    q: `[B, 1, N, H]` queries (N = K * G; head n uses key/value head n // G).
    k, v: `[B, K, H]` the new keys and values, written at ``write`` first.
    k_cache, v_cache: `[L, B, K, S, H]` the whole cache, as bits of ``dtype`` values.
    layer: the layer index (an int or a traced int32 scalar: the kernel's operand, so every
      layer of a scanned stack runs the same kernel).
    write: `[B]` int32, where each slot's new entry goes (its last live one).
    start: `[B]` int32, each slot's first live entry (<= write).
    block: the cache's block (a power of two dividing S); the kernel loops over blocks of
      ``min(block, KERNEL_BLOCK)`` positions.
    dtype: the cache values' dtype name.
    interpret: run in the Pallas interpreter (default: when the program is lowered for a
      CPU, `jax.lax.platform_dependent`; a GPU program compiled on a CPU host gets the kernel).

  Returns:
    (`[B, 1, N, H]` in q's dtype, k_cache, v_cache with the new entries).
  """
  b, _, n, h = q.shape
  num_layers, _, kv_heads, s, _ = k_cache.shape
  if s % block or block & (block - 1):
    raise ValueError(f"pallas_ragged_attention block={block} must be a power of two dividing the "
                     f"cache length {s}")
  g = n // kv_heads
  k_cache, v_cache = ragged_write(k, v, k_cache, v_cache, layer, write, dtype)
  kernel = functools.partial(_kernel, block=min(block, KERNEL_BLOCK), dtype=jnp.dtype(dtype),
                             scale=1.0 / math.sqrt(h))
  whole = pl.BlockSpec((b,), lambda i, j: (0,))
  cache = pl.BlockSpec((num_layers, None, None, s, h), lambda i, j: (0, i, j, 0, 0))
  heads = pl.BlockSpec((None, None, g, h), lambda i, j: (i, j, 0, 0))

  def call(interpret: bool, *args: jax.Array) -> jax.Array:
    return pl.pallas_call(
        kernel, grid=(b, kv_heads),
        in_specs=[pl.BlockSpec((1,), lambda i, j: (0,)), whole, whole, heads, cache, cache],
        out_specs=heads, out_shape=jax.ShapeDtypeStruct((b, kv_heads, g, h), q.dtype),
        interpret=interpret, compiler_params=pltriton.CompilerParams(),
        name="ragged_decode_attention")(*args)

  args = (jnp.reshape(jnp.asarray(layer, jnp.int32), (1,)), start.astype(jnp.int32),
          (write + 1).astype(jnp.int32), q.reshape(b, kv_heads, g, h), k_cache, v_cache)
  if interpret is None:  # chosen when the program is lowered, for the platform it is lowered for
    out = lax.platform_dependent(*args, cpu=functools.partial(call, True),
                                 default=functools.partial(call, False))
  else:
    out = call(interpret, *args)
  return out.reshape(b, 1, n, h), k_cache, v_cache
