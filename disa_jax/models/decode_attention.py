"""Decode attention over a head-major ragged KV cache (the JAX sampler's, `disa_jax.rollout`).

`RaggedKV` holds one sequence per slot b of B: ``k``, ``v`` `[L, B, K, S, H]`, head-major (the K
key/value heads before the S positions, the layout the scores' einsum reads, so no step transposes
the cache). Slot b's live entries are ``[start[b], write[b]]``; a decode step writes each slot's new
key and value at ``write[b]`` (a scatter into the cache, which is a loop carry of the caller's
program: updated in place, never copied), and attends over the live entries only
(`ragged_attention`): the positions run in blocks of ``block`` with an online softmax (float32
scores, as `attention.gqa_attention`). The loop over blocks has a static trip count, every block
of the cache, its dead positions masked ('xla': a GPU runs it without reading its predicate back
to the host), or bounds from the live range, ``[min(start) // block, ceil(max(write + 1) /
block))`` ('xla_live': the work follows the longest live row, not S; a GPU then syncs with the
host every iteration, ~160 times per 4B decode step).

The cache holds its values' bits as unsigned ints of the same width (`kv_bits`; read back block
by block, a free bitcast): XLA:CPU runs a bfloat16 scatter in float32 on a converted copy of the
whole operand (twice the cache, per write), while it scatters integers in place, as every backend
does.

The XLA loop is the reference every backend runs (`ModelOptions.decode_attention` 'xla' /
'xla_live'); 'pallas' (`decode_attention_pallas`) runs the same computation as one Pallas kernel,
a program per (slot, key/value head) looping over its own live blocks on the device: it also skips
the blocks of the shorter rows, and a layer costs one launch instead of a loop of small kernels.

`run_layers` drives a model's layer function over the whole stacked cache: a Python loop over the
layers, or a `jax.lax.scan` whose carry (not its stacked outputs) is the cache, so the cache is
updated in place in both.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp

from disa_jax.models.attention import MASK_VALUE
from disa_jax.models.decode_attention_pallas import pallas_ragged_attention
from disa_jax.models.kv_bits import as_bits, from_bits

# The decode attention implementations (`ModelOptions.decode_attention`; 'auto' = `resolve`).
IMPLS = ("auto", "xla", "xla_live", "pallas")
# 'auto' on a CPU loops over every block while the cache holds at most this many: there the
# live-bounds loop's data-dependent trip count costs more than the few dead blocks it skips (the
# JAX sampler on the default job's request, a cache of 5 blocks: 0.75x the seconds per decode step,
# the same tokens and log-probs bit for bit; benchmarks/results/sampler_phases_cpu.txt).
CPU_STATIC_BLOCKS = 8


def resolve(impl: str, backend: str, blocks: int | None = None) -> str:
  """'auto': 'xla_live' when the program is for a CPU (``backend``; its loop runs on the host
  anyway, and skips the blocks past every slot's end) and the cache has more than
  `CPU_STATIC_BLOCKS` ``blocks`` (None: unknown), 'xla' otherwise (no host round trip per block
  on an accelerator; the same output either way, `ragged_attention`); others unchanged."""
  if impl == "auto":
    many = blocks is None or blocks > CPU_STATIC_BLOCKS
    return "xla_live" if backend == "cpu" and many else "xla"
  return impl


@functools.partial(jax.tree_util.register_dataclass, data_fields=["k", "v", "write", "start"],
                   meta_fields=["block", "dtype"])
@dataclasses.dataclass(frozen=True)
class RaggedKV:
  """The sampler's KV cache during one decode step (see the module docstring).

  Attributes:
    k, v: `[L, B, K, S, H]` keys and values, head-major, as the bits of ``dtype`` values.
    write: `[B]` int32, where each slot's new key and value go (its last live entry).
    start: `[B]` int32, each slot's first live entry.
    block: positions per attention block (static; divides S).
    dtype: the values' dtype name (static).
  """
  k: jax.Array
  v: jax.Array
  write: jax.Array
  start: jax.Array
  block: int
  dtype: str

  def update_and_attend(self, q: jax.Array, k: jax.Array, v: jax.Array, layer: Any,
                        impl: str = "xla") -> tuple[jax.Array, "RaggedKV"]:
    """Writes one layer's new entries and attends over the live ones.

    Args:
      q: `[B, 1, N, H]` queries of the new tokens.
      k, v: `[B, 1, K, H]` their keys and values.
      layer: the layer index (int, or a traced int32 scalar under a scan).
      impl: one of `IMPLS` but 'auto' (`resolve`): 'xla' (`ragged_attention` over every block
        of the cache, the reference), 'xla_live' (over the live blocks only) or 'pallas'
        (`decode_attention_pallas.pallas_ragged_attention`).

    Returns:
      (`[B, 1, N, H]` attention output in q's dtype, the cache with the new entries).
    """
    args = (q, k[:, 0], v[:, 0], self.k, self.v, layer, self.write, self.start, self.block,
            self.dtype)
    if impl == "pallas":
      out, kc, vc = pallas_ragged_attention(*args)
    else:
      out, kc, vc = ragged_attention(*args, live_bounds=impl == "xla_live")
    return out, dataclasses.replace(self, k=kc, v=vc)


def ragged_attention(q: jax.Array, k: jax.Array, v: jax.Array, k_cache: jax.Array,
                     v_cache: jax.Array, layer: Any, write: jax.Array, start: jax.Array,
                     block: int, dtype: Any, *, live_bounds: bool = False
                     ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Writes each slot's new key and value at ``write``, then attends with one query per slot over
  its live entries ``[start, write]``, block by block.

  The loop visits every block of the cache (a static trip count: on a GPU the loop runs without
  reading anything back to the host; the blocks outside a slot's live range add exactly 0), or
  with ``live_bounds`` the blocks ``[min(start) // block, ceil(max(write + 1) / block))`` only
  (bounds from device data: a GPU reads the loop predicate back to the host every iteration).
  Both give the same output when the cache holds finite values outside the live ranges.

  The caches are the block loop's carry and every iteration writes the new entries (the same
  values: a `[B, K, H]` scatter): the loop then updates the caches, so XLA neither copies them
  for the loop nor for the next layer's write; a loop that only read them would get them copied
  whole on every layer, since the next layer writes them in place.

  Args:
    q: `[B, 1, N, H]` queries (N = K * G; head n uses key/value head n // G).
    k, v: `[B, K, H]` the new keys and values.
    k_cache, v_cache: `[L, B, K, S, H]` the whole cache, as bits (`as_bits`) of ``dtype``
      values; layer ``layer``'s is written and read.
    layer: int or traced int32 scalar.
    write: `[B]` int32, where each slot's new entry goes (its last live one).
    start: `[B]` int32, each slot's first live entry (<= write).
    block: positions per block; must divide S.
    dtype: the cache values' dtype.
    live_bounds: loop over the live blocks only (data-dependent bounds) instead of all S / block.

  Returns:
    (`[B, 1, N, H]` in q's dtype, k_cache, v_cache with the new entries).
  """
  b, _, n, h = q.shape
  _, _, kv_heads, s, _ = k_cache.shape
  if s % block:
    raise ValueError(f"ragged_attention block={block} must divide the cache length {s}")
  g = n // kv_heads
  qh = q.reshape(b, kv_heads, g, h)
  scale = 1.0 / math.sqrt(h)
  rows = jnp.arange(b)
  end = write + 1
  if live_bounds:
    first, last = jnp.min(start) // block, (jnp.max(end) + block - 1) // block
  else:
    first, last = 0, s // block
  k_bits, v_bits = as_bits(k.astype(dtype)), as_bits(v.astype(dtype))

  def body(i, carry):
    m, l, acc, k_cache, v_cache = carry  # [B, K, G] running max and sum, [B, K, G, H] numerator
    k_cache = k_cache.at[layer, rows, :, write, :].set(k_bits)
    v_cache = v_cache.at[layer, rows, :, write, :].set(v_bits)
    at = i * block
    kb, vb = (from_bits(jax.lax.dynamic_slice(x, (layer, 0, 0, at, 0),
                                              (1, b, kv_heads, block, h))[0], dtype)
              for x in (k_cache, v_cache))  # [B, K, block, H]
    scores = jnp.einsum("bkgh,bksh->bkgs", qh, kb.astype(q.dtype),
                        preferred_element_type=jnp.float32) * scale
    pos = at + jnp.arange(block, dtype=jnp.int32)
    valid = ((pos[None] >= start[:, None]) & (pos[None] < end[:, None]))[:, None, None]
    scores = jnp.where(valid, scores, MASK_VALUE)
    m_new = jnp.maximum(m, jnp.max(scores, axis=-1))
    alpha = jnp.exp(m - m_new)
    p = jnp.where(valid, jnp.exp(scores - m_new[..., None]), 0.0)
    vb = vb.astype(q.dtype)
    pv = jnp.einsum("bkgs,bksh->bkgh", p.astype(vb.dtype), vb, preferred_element_type=jnp.float32)
    return m_new, alpha * l + jnp.sum(p, axis=-1), alpha[..., None] * acc + pv, k_cache, v_cache

  init = (jnp.full((b, kv_heads, g), MASK_VALUE, jnp.float32),
          jnp.zeros((b, kv_heads, g), jnp.float32), jnp.zeros((b, kv_heads, g, h), jnp.float32),
          k_cache, v_cache)
  _, l, acc, k_cache, v_cache = jax.lax.fori_loop(first, last, body, init)
  return (acc / l[..., None]).reshape(b, 1, n, h).astype(q.dtype), k_cache, v_cache


def run_layers(layer: Callable[[jax.Array, dict[str, jax.Array], RaggedKV, Any],
                               tuple[jax.Array, RaggedKV]],
               x: jax.Array, stacked: dict[str, jax.Array], cache: RaggedKV, *,
               unrolled: bool) -> tuple[jax.Array, RaggedKV]:
  """Runs ``layer(x, params_i, cache, i)`` over the L stacked layers, threading the whole cache.

  Args:
    layer: one decoder layer; returns (x, the cache with layer i's new entries).
    x: `[B, 1, D]` the new tokens' embeddings.
    stacked: the layers' `[L, ...]` parameters.
    cache: the ragged cache.
    unrolled: a Python loop (static layer indices) instead of a scan (traced indices).

  Returns:
    (x after the last layer, the updated cache).
  """
  num_layers = cache.k.shape[0]
  if unrolled:
    for i in range(num_layers):
      x, cache = layer(x, {name: a[i] for name, a in stacked.items()}, cache, i)
    return x, cache

  def body(carry, xs):
    p, i = xs
    return layer(carry[0], p, carry[1], i), None

  (x, cache), _ = jax.lax.scan(body, (x, cache), (stacked, jnp.arange(num_layers)))
  return x, cache
