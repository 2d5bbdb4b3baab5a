"""Ragged decode attention as one Pallas kernel per layer (``decode_attention='pallas'``).

The same computation as `decode_attention.ragged_attention` (the XLA reference every backend
runs): one query per slot attends over the slot's live cache entries ``[start, write]`` of a
head-major cache `[L, B, K, S, H]` held as the bits of its values, with an online softmax over
blocks of ``block`` positions (float32 scores; probabilities cast to the values' dtype before the
value product, as the reference does). What differs is where the loop over blocks runs:

- the reference runs one XLA while loop per layer whose bounds span the live blocks of *every*
  slot (``[min(start) // block, ceil(max(write + 1) / block))``), each iteration a handful of
  kernels over all B slots, and on a GPU each iteration reads its loop predicate back to the host;
- here one kernel launch per layer runs a program per (slot, key/value head) that loops over its
  *own* live blocks on the device: a short row reads only its own blocks, and a layer costs one
  launch.

The new key and value of each slot are written first (`ragged_write`, an in-place scatter into the
cache, which is the caller's loop carry); the kernel only reads the cache. The layer's cache is
selected by the kernel's block index, so the layer must be a Python int: the model runs its
layers unrolled on this path (`Transformer.decode_ragged`).

Written for the Triton lowering (GPU); on a CPU it runs in the Pallas interpreter (the tests,
which compare it with the reference). The G query heads of a key/value head are one program's
`[G, H]` query block; scores and the value product are broadcast products reduced in float32 (G is
small, below the 16 rows a Triton matrix product needs).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from disa_jax.models.attention import MASK_VALUE
from disa_jax.models.kv_bits import as_bits, from_bits


def ragged_write(k: jax.Array, v: jax.Array, k_cache: jax.Array, v_cache: jax.Array, layer: int,
                 write: jax.Array, dtype: Any) -> tuple[jax.Array, jax.Array]:
  """Writes each slot's new key and value at ``write`` of layer ``layer`` (in place).

  Args:
    k, v: `[B, K, H]` the new keys and values.
    k_cache, v_cache: `[L, B, K, S, H]` the cache, as bits of ``dtype`` values.
    layer: the layer index.
    write: `[B]` int32 positions.
    dtype: the cache values' dtype.

  Returns:
    The two caches with the new entries.
  """
  rows = jnp.arange(k.shape[0])
  k_bits, v_bits = as_bits(k.astype(dtype)), as_bits(v.astype(dtype))
  return (k_cache.at[layer, rows, :, write, :].set(k_bits),
          v_cache.at[layer, rows, :, write, :].set(v_bits))


def _kernel(start_ref, end_ref, q_ref, k_ref, v_ref, o_ref, *, block: int, dtype: Any,
            scale: float):
  """One (slot b, key/value head) program: ``q_ref`` `[G, H]`, ``k_ref`` / ``v_ref`` `[S, H]`
  (the slot's cache of this head, bits), ``o_ref`` `[G, H]`."""
  b = pl.program_id(0)
  lo, hi = start_ref[b], end_ref[b]  # live entries [lo, hi)
  q = q_ref[...].astype(jnp.float32)  # [G, H]
  g, h = q.shape

  def body(i, carry):
    m, l, acc = carry  # [G], [G], [G, H]
    sl = pl.ds(i * block, block)
    kb = from_bits(k_ref[sl, :], dtype).astype(q_ref.dtype).astype(jnp.float32)  # [block, H]
    vb = from_bits(v_ref[sl, :], dtype).astype(q_ref.dtype)
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
                            v_cache: jax.Array, layer: int, write: jax.Array, start: jax.Array,
                            block: int, dtype: str, interpret: bool | None = None
                            ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """`decode_attention.ragged_attention` with the loop over blocks in one Pallas kernel.

  Args:
    q: `[B, 1, N, H]` queries (N = K * G; head n uses key/value head n // G).
    k, v: `[B, K, H]` the new keys and values, written at ``write`` first.
    k_cache, v_cache: `[L, B, K, S, H]` the whole cache, as bits of ``dtype`` values.
    layer: the layer index (a Python int: it selects the kernel's block of the cache).
    write: `[B]` int32, where each slot's new entry goes (its last live one).
    start: `[B]` int32, each slot's first live entry (<= write).
    block: positions per block (a power of two dividing S).
    dtype: the cache values' dtype name.
    interpret: run in the Pallas interpreter (default: on the CPU backend).

  Returns:
    (`[B, 1, N, H]` in q's dtype, k_cache, v_cache with the new entries).
  """
  if not isinstance(layer, int):
    raise ValueError(f"pallas_ragged_attention needs a Python int layer (the layers run "
                     f"unrolled on this path), got {type(layer).__name__}")
  b, _, n, h = q.shape
  _, _, kv_heads, s, _ = k_cache.shape
  if s % block or block & (block - 1):
    raise ValueError(f"pallas_ragged_attention block={block} must be a power of two dividing the "
                     f"cache length {s}")
  if interpret is None:
    interpret = jax.default_backend() == "cpu"
  g = n // kv_heads
  k_cache, v_cache = ragged_write(k, v, k_cache, v_cache, layer, write, dtype)
  kernel = functools.partial(_kernel, block=block, dtype=jnp.dtype(dtype),
                             scale=1.0 / math.sqrt(h))
  whole = pl.BlockSpec((b,), lambda i, j: (0,))
  cache = pl.BlockSpec((None, None, None, s, h), lambda i, j: (layer, i, j, 0, 0))
  heads = pl.BlockSpec((None, None, g, h), lambda i, j: (i, j, 0, 0))
  out = pl.pallas_call(
      kernel, grid=(b, kv_heads), in_specs=[whole, whole, heads, cache, cache], out_specs=heads,
      out_shape=jax.ShapeDtypeStruct((b, kv_heads, g, h), q.dtype), interpret=interpret,
      name="ragged_decode_attention")(start.astype(jnp.int32), (write + 1).astype(jnp.int32),
                                       q.reshape(b, kv_heads, g, h), k_cache, v_cache)
  return out.reshape(b, 1, n, h), k_cache, v_cache
