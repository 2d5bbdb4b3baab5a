"""Block-sparse attention over packed rows in plain XLA (`attention_impl='xla'`).

The queries run in blocks; query block `[lo, hi)` is compared with the keys `[max(0, lo - w + 1),
hi)` only, through the dense core (`attention._attend`, its mask built for that block from the
`SegmentLayout`: no `[B, T, T]` mask exists). The key ranges are static, so the skipped
(query block, key block) pairs cost nothing in the compiled program:

- causal: every key after a block's last query (the upper triangle);
- the band: with ``window`` = w, the longest segment a row can hold (packing's longest sequence,
  `Transformer.max_segment_len`), a query's segment starts at most w - 1 tokens back, so keys
  further back never share its segment. A block of b queries then scores b (w - 1 + b) keys, and
  the whole row T (w - 1 + b): for rows of equal segments of length w, sum(segment^2) (1 + b / w)
  instead of T^2 / 2. The segment layout itself is data (it changes every batch), so no static
  program can skip more: a query at the start of its segment may sit anywhere in the band, which
  is why the band costs twice the causal part of each segment. A row with a longer segment than
  w would lose keys: its output is NaN instead (`segment_span`), so it cannot pass unnoticed.

With ``chunk`` (``attention_chunk``) the blocks are c queries each and the backward pass
recomputes each block's probabilities instead of keeping them (`[B, N, c, keys]` float32 at a
time), the memory-bounded path for long rows. It is a custom VJP rather than a `jax.checkpoint`
per block: under a layer remat policy that keeps q, k and v by name, checkpointed blocks each kept
their own copy of the full q, k and v (`benchmarks/plan_memory.py`, Qwen3-4B, one 8,192-token row,
'save_qkv_attn': 88.7 GiB of temporaries that way, 41.7 GiB here, 35.6 GiB with 'full'); here the
attention's residuals are its inputs themselves.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from disa_jax.models import attention as A

MIN_BAND_BLOCK = 16  # query rows per block in a band (at least)
BAND_BLOCKS_PER_WINDOW = 4  # blocks of w / 4 queries: each scores w - 1 + w / 4 keys
MAX_BAND_BLOCKS = 64  # at most this many blocks in a row (each is a separate set of ops)


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


def block_schedule(t: int, *, window: int = 0, chunk: int = 0) -> list[tuple[int, int, int]]:
  """The live blocks `[(q_lo, q_hi, k_lo), ...]`: queries `[q_lo, q_hi)` against keys
  `[k_lo, q_hi)`.

  Args:
    t: tokens per row.
    window: the longest segment (0 = T: causal skipping only).
    chunk: query rows per block when > 0 (the checkpointed path), else `block_size(t, window)`.
  """
  size = chunk if 0 < chunk < t else block_size(t, window)
  reach = window if 0 < window < t else t
  return [(lo, min(lo + size, t), max(0, lo - reach + 1)) for lo in range(0, t, size)]


def attention_flops(t: int, *, batch: int, heads: int, head_dim: int, window: int = 0,
                    chunk: int = 0) -> int:
  """Matmul FLOPs of the forward pass over the schedule (2 matmuls of 2 FLOPs per multiply-add)."""
  pairs = sum((hi - lo) * (hi - k_lo) for lo, hi, k_lo in block_schedule(t, window=window,
                                                                           chunk=chunk))
  return 4 * batch * heads * head_dim * pairs


def _block(q: jax.Array, k: jax.Array, v: jax.Array, layout: A.SegmentLayout,
           bounds: tuple[int, int, int]) -> jax.Array:
  lo, hi, k_lo = bounds
  mask = A.layout_mask(layout, lo, hi, k_lo, hi)
  core = A._attend  # pylint: disable=protected-access  (looked up per call: tests wrap it)
  return core(q[:, lo:hi], k[:, k_lo:hi], v[:, k_lo:hi], mask)


def _blocks(q, k, v, layout, schedule) -> jax.Array:
  outs = [_block(q, k, v, layout, b) for b in schedule]
  return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _checkpointed(q, k, v, layout, schedule):
  """`_blocks` checkpointed by hand (the chunked path): the backward recomputes each block's
  probabilities, and the only residuals are the inputs, the very q, k, v a remat policy may keep
  by name (a `jax.checkpoint` per block would hand each block its own copy of them)."""
  return _blocks(q, k, v, layout, schedule)


def _checkpointed_fwd(q, k, v, layout, schedule):
  return _blocks(q, k, v, layout, schedule), (q, k, v, layout)


def _checkpointed_bwd(schedule, res, dy):
  q, k, v, layout = res
  attend_fwd, attend_bwd = A._attend_fwd, A._attend_bwd  # pylint: disable=protected-access
  dq, dk, dv = [], jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32)
  for lo, hi, k_lo in schedule:
    mask = A.layout_mask(layout, lo, hi, k_lo, hi)
    _, saved = attend_fwd(q[:, lo:hi], k[:, k_lo:hi], v[:, k_lo:hi], mask)
    dq_b, dk_b, dv_b, _ = attend_bwd(saved, dy[:, lo:hi])
    dq.append(dq_b)
    dk = dk.at[:, k_lo:hi].add(dk_b.astype(jnp.float32))
    dv = dv.at[:, k_lo:hi].add(dv_b.astype(jnp.float32))
  dq = dq[0] if len(dq) == 1 else jnp.concatenate(dq, axis=1)
  return dq, dk.astype(k.dtype), dv.astype(v.dtype), jax.tree.map(lambda _: None, layout)


_checkpointed.defvjp(_checkpointed_fwd, _checkpointed_bwd)


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
  schedule = tuple(block_schedule(t, window=window, chunk=chunk))
  out = (_checkpointed if 0 < chunk < t else _blocks)(q, k, v, layout, schedule)
  if 0 < window < t:
    fits = jnp.all(A.segment_span(layout) <= window, axis=1)
    out = jnp.where(fits[:, None, None, None], out, jnp.asarray(math.nan, out.dtype))
  return out
