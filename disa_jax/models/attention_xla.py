"""Block-sparse attention over packed rows in plain XLA (`attention_impl='xla'`).

The row is cut into blocks of b tokens, and query block i is compared with key blocks j <= i only
(`pair_schedule`), in ONE rolled loop (`jax.lax.scan`) over the live (i, j) pairs with an online
softmax (a running maximum and sum per query, flash-attention style): the program holds one pair's
`[B, N, b, b]` float32 scores at a time, and its size and compile time do not grow with the number
of blocks (issue 66: the former Python-unrolled query blocks, each with its own key length, took
242 s to compile for an H100 at 16k-token rows, two layers, against 33 s for cuDNN). The backward
pass is a second loop over the same pairs that recomputes each pair's probabilities from the saved
log-sum-exp (a custom VJP: its residuals are q, k, v, the output and the log-sum-exp, so a remat
policy that keeps q, k and v by name keeps no extra copies). The mask of a pair is built from the
`SegmentLayout` (no `[B, T, T]` mask exists). Which pairs are live is static, so the skipped ones
cost nothing in the compiled program:

- causal: every key block after the query block (the upper triangle);
- the band: with ``window`` = w, the longest segment a row can hold (packing's longest sequence,
  `Transformer.max_segment_len`), a query's segment starts at most w - 1 tokens back, so key
  blocks further back never share its segment. A block of b queries then scores about w - 1 + 2b
  keys, and the whole row T (w - 1 + 2b): for rows of equal segments of length w, about
  sum(segment^2) (1 + 2b / w) instead of T^2 / 2. The segment layout itself is data (it changes
  every batch), so no static program can skip more: a query at the start of its segment may sit
  anywhere in the band, which is why the band costs about twice the causal part of each segment.
  A row with a longer segment than w would lose keys: its output is NaN instead (`segment_span`),
  so it cannot pass unnoticed.

The block size is ``chunk`` (``attention_chunk``) when given, else `block_size`. Compiled FLOPs
follow `attention_flops` (XLA's own cost analysis counts a loop body once; `parallel.hlo_facts`
counts it per trip).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from disa_jax.models import attention as A

MIN_BAND_BLOCK = 16  # query rows per block in a band (at least)
BAND_BLOCKS_PER_WINDOW = 4  # blocks of w / 4 queries: each scores w - 1 + w / 4 keys
MAX_BAND_BLOCKS = 64  # at most this many blocks in a row (bounds the pairs of the loop)


def block_size(t: int, window: int = 0) -> int:
  """Query rows per block for a row of T tokens (no chunking).

  Without a window (or with w >= T): as the causal path (`attention.causal_block_bounds`), at
  least `attention.CAUSAL_BLOCK` rows and at most `attention.MAX_CAUSAL_BLOCKS` blocks. With a
  window, about w / 4 rows (at least `MIN_BAND_BLOCK`, at most `MAX_BAND_BLOCKS` blocks).
  """
  causal = max(A.CAUSAL_BLOCK, -(-t // A.MAX_CAUSAL_BLOCKS))
  if not 0 < window < t:
    return causal
  band = max(MIN_BAND_BLOCK, -(-window // BAND_BLOCKS_PER_WINDOW), -(-t // MAX_BAND_BLOCKS))
  return min(causal, band)


def attention_flops(t: int, *, batch: int, heads: int, head_dim: int, window: int = 0,
                    chunk: int = 0) -> int:
  """Matmul FLOPs of the forward pass over the live pairs (2 matmuls of 2 FLOPs per multiply-add
  on each pair's b x b block)."""
  size, pairs = pair_schedule(t, window=window, chunk=chunk)
  return 4 * batch * heads * head_dim * size * size * len(pairs)


def pair_schedule(t: int, *, window: int = 0, chunk: int = 0) -> tuple[int, list[tuple[int, int]]]:
  """(block size b, the live (query block, key block) pairs): blocks of b tokens (``chunk`` when
  0 < chunk < T, else `block_size`), key block j <= query block i (causal) and, with a window w,
  j no further back than the block holding token i b - w + 1 (the band)."""
  size = chunk if 0 < chunk < t else block_size(t, window)
  reach = window if 0 < window < t else t
  blocks = -(-t // size)
  return size, [(i, j) for i in range(blocks)
                for j in range(max(0, (i * size - reach + 1) // size), i + 1)]


def _pair_mask(layout: A.SegmentLayout, i: jax.Array, j: jax.Array, size: int) -> jax.Array:
  """`[B, b, b]` bool: `attention.layout_mask` between query block i and key block j (traced)."""
  take = lambda x, blk: jax.lax.dynamic_slice_in_dim(x, blk * size, size, axis=1)
  sq, sk = take(layout.segment_ids, i)[:, :, None], take(layout.segment_ids, j)[:, None, :]
  pos = jnp.arange(size)
  causal = ((i * size + pos)[:, None] >= (j * size + pos)[None, :])[None]
  mask = causal & (sq == sk) & (sk > 0)
  if layout.branch_ids is not None:
    bq, bk = take(layout.branch_ids, i)[:, :, None], take(layout.branch_ids, j)[:, None, :]
    mask &= (bk == 0) | (bk == bq)
  return mask


def _pair_scores(qh, kt, layout, i, j, size):
  """(scaled scores `[B, K, G, b, b]` float32, masked to `MASK_VALUE`; the mask)."""
  qb = jax.lax.dynamic_slice_in_dim(qh, i * size, size, axis=3)
  kb = jax.lax.dynamic_slice_in_dim(kt, j * size, size, axis=2)
  s = jnp.einsum("bkgth,bksh->bkgts", qb, kb, preferred_element_type=jnp.float32)
  mask = _pair_mask(layout, i, j, size)[:, None, None]
  return jnp.where(mask, s * (1.0 / math.sqrt(qh.shape[-1])), A.MASK_VALUE), mask


def _pairs_array(pairs: tuple[tuple[int, int], ...]) -> jax.Array:
  return jnp.asarray(pairs, jnp.int32).reshape(-1, 2)


def _flash_fwd(qh, kt, vt, layout, size, pairs):
  """Online-softmax forward over the pairs (one rolled loop): (out `[B, K, G, T, H]` float32,
  log-sum-exp `[B, K, G, T]`; a query with no key: out 0, lse `MASK_VALUE`)."""
  b, kv, g, t, h = qh.shape

  def body(carry, ij):
    o, m, l = carry
    i, j = ij[0], ij[1]
    s, mask = _pair_scores(qh, kt, layout, i, j, size)
    m_old = jax.lax.dynamic_slice_in_dim(m, i * size, size, axis=3)
    l_old = jax.lax.dynamic_slice_in_dim(l, i * size, size, axis=3)
    o_old = jax.lax.dynamic_slice_in_dim(o, i * size, size, axis=3)
    m_new = jnp.maximum(m_old, jnp.max(s, axis=-1))
    p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
    scale = jnp.exp(m_old - m_new)
    vb = jax.lax.dynamic_slice_in_dim(vt, j * size, size, axis=2)
    pv = jnp.einsum("bkgts,bksh->bkgth", p.astype(vt.dtype), vb,
                    preferred_element_type=jnp.float32)
    put = lambda full, blk: jax.lax.dynamic_update_slice_in_dim(full, blk, i * size, axis=3)
    return (put(o, o_old * scale[..., None] + pv), put(m, m_new),
            put(l, l_old * scale + jnp.sum(p, axis=-1))), None

  init = (jnp.zeros((b, kv, g, t, h), jnp.float32), jnp.full((b, kv, g, t), A.MASK_VALUE),
          jnp.zeros((b, kv, g, t), jnp.float32))
  (o, m, l), _ = jax.lax.scan(body, init, _pairs_array(pairs))
  seen = l > 0
  out = jnp.where(seen[..., None], o / jnp.where(seen, l, 1.0)[..., None], 0.0)
  return out, jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), A.MASK_VALUE)


def _flash_bwd(qh, kt, vt, layout, size, pairs, out, lse, do):
  """dO -> (dQ, dK, dV) over the pairs, each pair's probabilities recomputed from lse:
  dV += P^T dO, dS = P (dO V^T - rowsum(dO O)) / sqrt(H), dQ += dS K, dK += dS^T Q."""
  delta = jnp.sum(do * out, axis=-1)  # [B, K, G, T]
  rows = lambda x, i: jax.lax.dynamic_slice_in_dim(x, i * size, size, axis=3)
  keys = lambda x, j: jax.lax.dynamic_slice_in_dim(x, j * size, size, axis=2)

  def body(carry, ij):
    dq, dk, dv = carry
    i, j = ij[0], ij[1]
    s, mask = _pair_scores(qh, kt, layout, i, j, size)
    p = jnp.where(mask, jnp.exp(s - rows(lse, i)[..., None]), 0.0)
    do_i = rows(do, i)
    dp = jnp.einsum("bkgth,bksh->bkgts", do_i, keys(vt, j).astype(jnp.float32))
    ds = p * (dp - rows(delta, i)[..., None]) * (1.0 / math.sqrt(qh.shape[-1]))
    dq_i = jnp.einsum("bkgts,bksh->bkgth", ds, keys(kt, j).astype(jnp.float32))
    dk_j = jnp.einsum("bkgts,bkgth->bksh", ds, rows(qh, i).astype(jnp.float32))
    dv_j = jnp.einsum("bkgts,bkgth->bksh", p, do_i)
    add_rows = lambda full, blk: jax.lax.dynamic_update_slice_in_dim(
        full, rows(full, i) + blk, i * size, axis=3)
    add_keys = lambda full, blk: jax.lax.dynamic_update_slice_in_dim(
        full, keys(full, j) + blk, j * size, axis=2)
    return (add_rows(dq, dq_i), add_keys(dk, dk_j), add_keys(dv, dv_j)), None

  zeros = lambda x: jnp.zeros(x.shape, jnp.float32)
  (dq, dk, dv), _ = jax.lax.scan(body, (zeros(qh), zeros(kt), zeros(vt)), _pairs_array(pairs))
  return dq, dk, dv


def _padded(x: jax.Array, t: int) -> jax.Array:
  """``x`` (`[B, T, ...]`) zero-padded along axis 1 to t tokens."""
  return x if x.shape[1] == t else jnp.pad(x, [(0, 0), (0, t - x.shape[1])] + [(0, 0)] * (
      x.ndim - 2))


def _head_major_padded(q, k, v, layout, t_pad):
  head_major = A._head_major  # pylint: disable=protected-access
  qh, kt, vt = head_major(*(_padded(x, t_pad) for x in (q, k, v)))
  lay = A.SegmentLayout(_padded(layout.segment_ids, t_pad),
                        None if layout.branch_ids is None else _padded(layout.branch_ids, t_pad),
                        _padded(layout.first, t_pad), _padded(layout.last, t_pad))
  return qh, kt, vt, lay


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _flash(q, k, v, layout, size, pairs):
  """Blocked attention in one rolled loop over the live block pairs (module docstring)."""
  return _flash_fwd_rule(q, k, v, layout, size, pairs)[0]


def _flash_fwd_rule(q, k, v, layout, size, pairs):
  t = q.shape[1]
  t_pad = -(-t // size) * size
  qh, kt, vt, lay = _head_major_padded(q, k, v, layout, t_pad)
  out, lse = _flash_fwd(qh, kt, vt, lay, size, pairs)
  y = A._token_major(out)[:, :t].astype(q.dtype)  # pylint: disable=protected-access
  return y, (q, k, v, layout, out, lse)


def _flash_bwd_rule(size, pairs, res, dy):
  q, k, v, layout, out, lse = res
  b, t, n, h = q.shape
  t_pad = out.shape[3]
  qh, kt, vt, lay = _head_major_padded(q, k, v, layout, t_pad)
  kv = kt.shape[1]
  do = _padded(dy, t_pad).astype(jnp.float32).reshape(b, t_pad, kv, n // kv, h).transpose(
      0, 2, 3, 1, 4)
  dq, dk, dv = _flash_bwd(qh, kt, vt, lay, size, pairs, out, lse, do)
  dq = A._token_major(dq)[:, :t]  # pylint: disable=protected-access
  dk, dv = (x.transpose(0, 2, 1, 3)[:, :t] for x in (dk, dv))
  return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype),
          jax.tree.map(lambda _: None, layout))


_flash.defvjp(_flash_fwd_rule, _flash_bwd_rule)


def xla_attention(q: jax.Array, k: jax.Array, v: jax.Array, layout: A.SegmentLayout, *,
                  window: int = 0, chunk: int = 0) -> jax.Array:
  """Block-sparse grouped-query self-attention over packed rows (see the module docstring).

  Args:
    q: `[B, T, N, H]` queries.
    k: `[B, T, K, H]` keys.
    v: `[B, T, K, H]` values.
    layout: the rows' `SegmentLayout`.
    window: the longest segment of any row (0 = no bound). A row with a longer one gets NaN.
    chunk: 0, or query rows per block, recomputed in the backward pass (``attention_chunk``).

  Returns:
    `[B, T, N, H]` in q's dtype; zero on padding rows.
  """
  t = q.shape[1]
  if k.shape[1] != t or layout.segment_ids.shape != q.shape[:2]:
    raise ValueError(f"self-attention over a layout needs q, k and segment ids of one length, got "
                     f"q {q.shape}, k {k.shape}, segment_ids {layout.segment_ids.shape}")
  size, pairs = pair_schedule(t, window=window, chunk=chunk)
  out = _flash(q, k, v, layout, size, tuple(pairs))
  if 0 < window < t:
    fits = jnp.all(A.segment_span(layout) <= window, axis=1)
    out = jnp.where(fits[:, None, None, None], out, jnp.asarray(math.nan, out.dtype))
  return out
