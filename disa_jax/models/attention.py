"""Grouped-query softmax attention: the dense reference core and the packed-row layout.

`gqa_attention` is the attention over an explicit boolean mask (the KV-cache path, and the
reference every other implementation is tested against). The scores and the softmax are float32
whatever the activations' dtype, as in the Hugging Face implementations. A query row with no
allowed key gets a zero output and passes no gradient (padding rows).

Three ways to run it, all with the same values up to float32 rounding:
- dense: one `[B, K, G, T, S]` score tensor;
- causal blocks (``causal=True``: the caller guarantees that the mask lies inside the causal
  triangle, T = S): the queries run in blocks, and block i is compared only with the keys
  before its end. This skips the upper triangle, 3/8 of the score work at 4 blocks;
- checkpointed query chunks (``query_chunk``): the memory-bounded path for long packed rows.

Packed rows are described without a `[B, T, T]` mask by a `SegmentLayout` (segment ids, optional
shared-prompt branch ids, and each token's segment extent); `layout_mask` gives any block of the
mask it implies. The implementations that take a layout (`attention_xla`, `attention_pallas`,
`attention_cudnn`, `attention_splash`; chosen by `attention_dispatch`) are tested against
`gqa_attention` on `dense_mask(layout)`.

The gradient of the core (`_attend`) is written out (FlashAttention's backward without the
tiling). The probabilities are kept from the forward pass in the head-major layout
`[B, K, G, T, S]`, where the key/value heads are batch dimensions: the K key/value heads are never
repeated G times, and dV and dK are computed as their transposes so that the probabilities are
contracted over their leading axes as the right-hand operand (as the left-hand one XLA:CPU copied
them whole first). Fwd+bwd of one d=512 layer's core (8 x 512 tokens, 8 heads / 4 kv heads,
float32, 2-core CPU, medians of 15): autodiff of the same value 166 ms, written out 146 ms, in 4
causal blocks 120 ms; the token-major einsums this replaced took 219 ms under autodiff, and
PyTorch's scaled_dot_product_attention (causal) 142 ms. `benchmarks/bench_models_speed.py` times
the whole train step; `benchmarks/bench_attention.py` the implementations.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

MASK_VALUE = float(np.finfo(np.float32).min)  # the score of a masked-out key, before the softmax
CAUSAL_BLOCK = 128  # query rows per causal block (at least)
MAX_CAUSAL_BLOCKS = 8  # at most this many blocks (each is a separate set of ops in the program)


def _head_major(q: jax.Array, k: jax.Array, v: jax.Array
                ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """q `[B, T, K*G, H]` -> `[B, K, G, T, H]`; k, v `[B, S, K, H]` -> `[B, K, S, H]`."""
  b, t, n, h = q.shape
  kv_heads = k.shape[2]
  qh = q.reshape(b, t, kv_heads, n // kv_heads, h).transpose(0, 2, 3, 1, 4)
  return qh, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)


def _token_major(x: jax.Array) -> jax.Array:
  """`[B, K, G, T, H]` -> `[B, T, K*G, H]`."""
  b, kv_heads, g, t, h = x.shape
  return x.transpose(0, 3, 1, 2, 4).reshape(b, t, kv_heads * g, h)


def _probs(qh: jax.Array, kt: jax.Array, mask: jax.Array) -> jax.Array:
  """`[B, K, G, T, S]` float32 softmax of the scaled, masked scores."""
  scores = jnp.einsum("bkgth,bksh->bkgts", qh, kt, preferred_element_type=jnp.float32)
  allowed = mask[:, None, None]
  scores = jnp.where(allowed, scores * (1.0 / math.sqrt(qh.shape[-1])), MASK_VALUE)
  return jnp.where(allowed, jax.nn.softmax(scores, axis=-1), 0.0)  # a row with no key: all 0


@jax.custom_vjp
def _attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
  """Dense attention (see `gqa_attention`): `[B, T, N, H]` in q's dtype."""
  qh, kt, vt = _head_major(q, k, v)
  p = _probs(qh, kt, mask)
  return _token_major(jnp.einsum("bkgts,bksh->bkgth", p.astype(v.dtype), vt))


def _attend_fwd(q, k, v, mask):
  qh, kt, vt = _head_major(q, k, v)
  p = _probs(qh, kt, mask)
  o = jnp.einsum("bkgts,bksh->bkgth", p.astype(v.dtype), vt)
  return _token_major(o), (qh, kt, vt, p, o, mask)


def _attend_bwd(res, dy):
  """dO -> (dQ, dK, dV): dV = P^T dO, dP = dO V^T, dS = P * (dP - rowsum(dO * O)) / sqrt(H)
  (zero where masked), dQ = dS K, dK = dS^T Q."""
  qh, kt, vt, p, o, mask = res
  b, kv_heads, g, t, h = qh.shape
  do = dy.reshape(b, t, kv_heads, g, h).transpose(0, 2, 3, 1, 4)  # [B, K, G, T, H]
  # dV and dK as their transposes `[B, K, H, S]`: contracting the big `[B, K, G, T, S]` operand
  # over its leading (G, T) axes as the right-hand side needs no copy of it; as the left-hand side,
  # XLA:CPU transposed all of it first.
  dv = jnp.einsum("bkgth,bkgts->bkhs", do, p.astype(do.dtype))
  dp = jnp.einsum("bkgth,bksh->bkgts", do, vt, preferred_element_type=jnp.float32)
  delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1, keepdims=True)
  ds = jnp.where(mask[:, None, None], p * (dp - delta) * (1.0 / math.sqrt(h)), 0.0)
  dq = jnp.einsum("bkgts,bksh->bkgth", ds.astype(kt.dtype), kt)
  dk = jnp.einsum("bkgth,bkgts->bkhs", qh, ds.astype(qh.dtype))
  return (_token_major(dq).astype(qh.dtype), dk.transpose(0, 3, 1, 2).astype(kt.dtype),
          dv.transpose(0, 3, 1, 2).astype(vt.dtype), None)


_attend.defvjp(_attend_fwd, _attend_bwd)


def causal_block_bounds(t: int) -> list[tuple[int, int]]:
  """The causal path's query blocks `[(start, end), ...]` over T rows: at least `CAUSAL_BLOCK`
  rows each and at most `MAX_CAUSAL_BLOCKS` blocks; one block when T <= `CAUSAL_BLOCK`."""
  size = max(CAUSAL_BLOCK, -(-t // MAX_CAUSAL_BLOCKS))
  return [(start, min(start + size, t)) for start in range(0, t, size)]


def _causal_blocks(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
  """Block i's queries against the keys `[0, end_i)`; the mask must lie in the causal triangle."""
  outs = [_attend(q[:, lo:hi], k[:, :hi], v[:, :hi], mask[:, lo:hi, :hi])
          for lo, hi in causal_block_bounds(q.shape[1])]
  return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)


def _query_chunks(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, chunk: int
                  ) -> jax.Array:
  """Queries in blocks of `chunk` under `jax.checkpoint` (the last one padded with rows that
  attend to nothing, dropped at the end)."""
  b, t, n, h = q.shape
  blocks = -(-t // chunk)
  pad = blocks * chunk - t
  if pad:
    q = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0)))
    mask = jnp.pad(mask, ((0, 0), (0, pad), (0, 0)))
  qb = q.reshape(b, blocks, chunk, n, h).swapaxes(0, 1)  # [B, T', N, H] -> [n, B, c, N, H]
  mb = mask.reshape(b, blocks, chunk, -1).swapaxes(0, 1)  # [B, T', S] -> [n, B, c, S]
  block = jax.checkpoint(lambda qi, mi: _attend(qi, k, v, mi))
  out = jax.lax.map(lambda xs: block(*xs), (qb, mb))  # [n, B, c, N, H]
  return out.swapaxes(0, 1).reshape(b, blocks * chunk, n, h)[:, :t]


def gqa_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, *,
                  query_chunk: int = 0, causal: bool = False) -> jax.Array:
  """Grouped-query softmax attention with an explicit boolean mask; softmax in float32.

  Args:
    q: `[B, T, N, H]` queries (N = K * G query heads; head n uses key/value head n // G).
    k: `[B, S, K, H]` keys.
    v: `[B, S, K, H]` values.
    mask: `[B, T, S]` bool, True where query t may attend to key s.
    query_chunk: 0 = no query chunking. c > 0 with T > c: the queries run in ceil(T / c) blocks
      under `jax.checkpoint`, so that forward and backward hold `[B, N, c, S]` scores at a time
      instead of `[B, N, T, S]` (each query row's softmax is still over all S keys).
    causal: the caller guarantees T = S and that `mask[:, t, s]` is False for s > t (a causal
      mask, possibly with padding or segments). The queries then run in `causal_block_bounds(T)`
      blocks against the keys up to each block's end. Ignored with query chunking.

  Returns:
    `[B, T, N, H]` attention output in q's dtype. A query row with no allowed key (padding) gets
    zeros and passes no gradient to k and v.
  """
  b, t, n, h = q.shape
  if query_chunk > 0 and t > query_chunk:
    return _query_chunks(q, k, v, mask, query_chunk)
  if causal:
    if k.shape[1] != t:
      raise ValueError(f"causal attention needs as many keys as queries, got q {q.shape} and "
                       f"k {k.shape}")
    return _causal_blocks(q, k, v, mask)
  return _attend(q, k, v, mask)


# ------------------------------------------------------------------------------------------------
# Packed rows without a [B, T, T] mask
# ------------------------------------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SegmentLayout:
  """Who attends to whom in self-attention over rows of T tokens (build with `packed_layout`).

  Query t may attend to key s when s <= t, both carry the same segment id and it is not 0
  (padding), and, with branch ids (shared prompts), the key's branch is 0 (the prompt) or the
  query's own.

  Attributes:
    segment_ids: `[B, T]` int32, 0 = padding.
    branch_ids: `[B, T]` int32 or None.
    first: `[B, T]` int32, the index of the first token of each token's segment id in its row.
    last: `[B, T]` int32, the index of the last token of each token's segment id in its row.
  """
  segment_ids: jax.Array
  branch_ids: jax.Array | None
  first: jax.Array
  last: jax.Array


def _segment_extent(seg: jax.Array) -> tuple[jax.Array, jax.Array]:
  """For `[B, T]` ids: the first and last index of each token's id in its row (`[B, T]` int32).

  A stable sort groups equal ids in row order, so a group's first and last members are the id's
  first and last occurrence, whatever the ids (they need not be contiguous runs)."""
  b, t = seg.shape
  idx = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  order = jnp.argsort(seg, axis=1, stable=True).astype(jnp.int32)
  ids = jnp.take_along_axis(seg, order, axis=1)
  change = ids[:, 1:] != ids[:, :-1]
  edge = jnp.ones((b, 1), bool)
  start = jax.lax.cummax(jnp.where(jnp.concatenate([edge, change], 1), idx, 0), axis=1)
  end = jax.lax.cummin(jnp.where(jnp.concatenate([change, edge], 1), idx, t), axis=1,
                       reverse=True)
  inverse = jnp.argsort(order, axis=1)
  back = lambda pos: jnp.take_along_axis(jnp.take_along_axis(order, pos, axis=1), inverse, axis=1)
  return back(start), back(end)


def packed_layout(segment_ids: jax.Array, branch_ids: jax.Array | None = None) -> SegmentLayout:
  """The `SegmentLayout` of packed rows.

  Args:
    segment_ids: `[B, T]` int, 0 = padding, k > 0 = the k-th sequence (or shared-prompt unit).
    branch_ids: `[B, T]` int or None: 0 on a unit's prompt, k on its k-th response.

  Returns:
    The layout, its segment extents computed once (every layer reads them).
  """
  seg = segment_ids.astype(jnp.int32)
  if branch_ids is not None and branch_ids.shape != seg.shape:
    raise ValueError(f"branch_ids must have the shape of segment_ids {seg.shape}, got "
                     f"{branch_ids.shape}")
  first, last = _segment_extent(seg)
  br = None if branch_ids is None else branch_ids.astype(jnp.int32)
  return SegmentLayout(seg, br, first, last)


def layout_mask(layout: SegmentLayout, q_lo: int, q_hi: int, k_lo: int, k_hi: int) -> jax.Array:
  """`[B, q_hi - q_lo, k_hi - k_lo]` bool: the mask between queries `[q_lo, q_hi)` and keys
  `[k_lo, k_hi)` of the rows (causal by index, same non-zero segment, branch rule)."""
  seg = layout.segment_ids
  sq, sk = seg[:, q_lo:q_hi, None], seg[:, None, k_lo:k_hi]
  causal = (jnp.arange(q_lo, q_hi)[:, None] >= jnp.arange(k_lo, k_hi)[None, :])[None]
  mask = causal & (sq == sk) & (sk > 0)
  if layout.branch_ids is not None:
    bq, bk = layout.branch_ids[:, q_lo:q_hi, None], layout.branch_ids[:, None, k_lo:k_hi]
    mask &= (bk == 0) | (bk == bq)
  return mask


def dense_mask(layout: SegmentLayout) -> jax.Array:
  """`[B, T, T]` bool: the whole mask (the dense reference path; tests)."""
  t = layout.segment_ids.shape[1]
  return layout_mask(layout, 0, t, 0, t)


def segment_span(layout: SegmentLayout) -> jax.Array:
  """`[B, T]` int32: how far back each real token's segment reaches (index - first index of its
  id, + 1): the keys a query can need; 0 on padding."""
  t = layout.segment_ids.shape[1]
  span = jnp.arange(t, dtype=jnp.int32)[None] - layout.first + 1
  return jnp.where(layout.segment_ids > 0, span, 0)
