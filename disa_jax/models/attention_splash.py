"""JAX's splash attention over packed rows (`attention_impl='splash'`; TPU).

A library call: `jax.experimental.pallas.ops.tpu.splash_attention` with a causal mask (its
static block sparsity skips the upper triangle) and the rows' segment ids (`SegmentIds`; splash
applies them per entry, so blocks of other segments are still computed). The K key/value heads are
passed as they are (splash's grouped-query mode). Splash keeps one row at a time (`[heads, T, H]`):
the batch is a `jax.vmap`. Queries are scaled by 1 / sqrt(H) first (splash does not scale). Rows
are padded to a multiple of the block; padding tokens (segment 0) attend among themselves in
splash and are zeroed afterwards. Splash names its forward residuals ``attn_lse`` for the remat
policies. Shared-prompt branch masks are not expressed (the dispatcher sends those to 'xla').
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask

from disa_jax.models import attention as A

BLOCK = 512  # splash block (queries and keys) on a TPU; at most the padded row length


def _kernel(t: int, heads: int, block: int, interpret: bool):
  mask = splash_mask.MultiHeadMask([splash_mask.CausalMask((t, t))] * heads)
  sizes = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block,
                            block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
                            block_q_dq=block, block_kv_dq=block)
  return splash.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1,
                                residual_checkpoint_name="attn_lse", interpret=interpret)


def splash_attention(q: jax.Array, k: jax.Array, v: jax.Array, layout: A.SegmentLayout, *,
                     block: int = BLOCK, interpret: bool = False) -> jax.Array:
  """Grouped-query self-attention over packed rows by splash attention (module docstring).

  Args:
    q: `[B, T, N, H]` queries.
    k: `[B, T, K, H]` keys.
    v: `[B, T, K, H]` values.
    layout: the rows' `SegmentLayout` (no branch ids).
    block: splash's block size (rows are padded to a multiple of it).
    interpret: run the kernels in the Pallas interpreter.

  Returns:
    `[B, T, N, H]` in q's dtype; zero on padding rows.
  """
  if layout.branch_ids is not None:
    raise ValueError("attention_impl='splash' cannot run shared-prompt branch masks")
  b, t, n, h = q.shape
  block = min(block, -(-t // 128) * 128)
  tp = -(-t // block) * block
  pad = lambda x: jnp.pad(x, [(0, 0), (0, tp - t)] + [(0, 0)] * (x.ndim - 2))
  heads_first = lambda x: pad(x).transpose(0, 2, 1, 3)  # [B, T, heads, H] -> [B, heads, T', H]
  kernel = _kernel(tp, n, block, interpret)
  seg = pad(layout.segment_ids)
  row = lambda qi, ki, vi, si: kernel(qi, ki, vi, segment_ids=splash.SegmentIds(si, si))
  out = jax.vmap(row)(heads_first(q * (1.0 / math.sqrt(h))), heads_first(k), heads_first(v), seg)
  out = out.transpose(0, 2, 1, 3)[:, :t]
  return jnp.where((layout.segment_ids > 0)[:, :, None, None], out, 0).astype(q.dtype)
