"""cuDNN flash attention over packed rows (`attention_impl='cudnn'`; NVIDIA GPUs, Hopper or later).

`jax.nn.dot_product_attention(implementation='cudnn')` takes per-row lengths only. The packed
("THD") layout, several segments per row, is reached through JAX's cuDNN module itself
(`jax._src.cudnn.fused_attention_stablehlo.dot_product_attention`, a private API: its
``q_offsets`` / ``kv_offsets``), with the causal-within-segment mask ``PADDING_CAUSAL``. cuDNN
then computes each segment's causal triangle only, in bfloat16 / float16.

From the segment ids, `packed_segments` builds ``[B, M]`` segment lengths and ``[B, M + 1]``
start offsets (-1 where a row has fewer segments), M = ``max_segments`` a static bound (the
packing's sequences per row, `workflows.stage3.model_options`). It must be given: cuDNN sizes its
softmax statistics and backward workspace by B x M, so one slot per token (M = T) took 32 GiB per
layer call at 16k-token rows where the 16 real sequences need 32 MiB (issue 66: an 8 TiB
allocation on an H200); 0 is refused. cuDNN's segments are contiguous runs of one id: a row with more runs than M, or an id
that comes back after another one, gets NaN (it would be computed wrongly), as do rows of the
banded XLA path that break their bound. Padding tokens belong to no segment; their rows are
zeroed.

Grouped-query heads: JAX converts the offsets into element offsets with the query's per-token
stride N x H for the keys too, which is wrong whenever K < N (the keys then start at the wrong
tokens, silently; fixed in jax-ml/jax#39521, July 2026). `kv_offsets_use_kv_heads` runs that
conversion on a tiny case on the host to see which behaviour the installed JAX has; without the
fix the K key/value heads are repeated to N before the call (correct; K/V memory and bandwidth x
G). JAX 0.10.2 (installed here) has the bug.

This module cannot run on a CPU: the tests check the argument construction, the bug probe and the
repeat-KV equivalence; `benchmarks/bench_attention.py --gpu` runs it against the reference.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from disa_jax.models import attention as A

try:  # private JAX module (the packed layout has no public entry point in JAX 0.10)
  from jax._src.cudnn import fused_attention_stablehlo as _cudnn
except ImportError:  # pragma: no cover - a JAX without it; `cudnn_available` says so
  _cudnn = None

DTYPES = (jnp.bfloat16, jnp.float16)
MAX_HEAD_DIM = 128  # cuDNN flash attention: head_dim <= 128 (and a multiple of 8) on Hopper


def cudnn_available() -> bool:
  """Whether this JAX has the cuDNN attention module with the packed layout."""
  return _cudnn is not None and hasattr(_cudnn, "_fix_seqlen_offsets")


def unsupported(dtype, head_dim: int, branches: bool, capability: str | None = None) -> str:
  """Why cuDNN cannot run this call ('' when it can); ``capability``: the GPU's compute capability
  (e.g. '8.0'; None = not known here)."""
  if capability is not None and tuple(int(x) for x in capability.split(".")) < (9, 0):
    return (f"compute capability {capability} (cuDNN's packed layout needs Hopper, 9.0, or "
            "later; issue 66: the paper's A100s)")
  if branches:
    return "shared-prompt branch masks are not a cuDNN mask"
  if jnp.dtype(dtype) not in [jnp.dtype(d) for d in DTYPES]:
    return f"dtype {jnp.dtype(dtype).name} (cuDNN flash attention: bfloat16 / float16)"
  if head_dim > MAX_HEAD_DIM or head_dim % 8:
    return f"head_dim {head_dim} (needs a multiple of 8 up to {MAX_HEAD_DIM})"
  if not cudnn_available():
    return f"this JAX ({jax.__version__}) has no cuDNN packed-attention module"
  return ""


@functools.cache
def kv_offsets_use_kv_heads() -> bool:
  """Whether JAX scales the packed layout's key offsets by the key/value heads (see the module
  docstring): its offset conversion, run on the host for 2 query heads over 1 key/value head."""
  if not cudnn_available():
    return False
  q, k = jnp.zeros((1, 4, 2, 8)), jnp.zeros((1, 4, 1, 8))
  lengths = jnp.asarray([[2, 2]], jnp.int32)
  offsets = jnp.asarray([[0, 2, -1]], jnp.int32)
  with jax.core.eval_context():  # evaluated now, even when first asked while tracing
    convert = _cudnn._fix_seqlen_offsets  # pylint: disable=protected-access
    _, _, _, kv = convert(lengths, lengths, offsets, offsets, q, k)
    return int(kv[0, 1]) == 2 * 1 * 8  # the second segment starts 2 tokens of 1 head x 8 in


def packed_segments(layout: A.SegmentLayout, max_segments: int
                    ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """cuDNN's description of packed rows.

  Args:
    layout: the rows' `SegmentLayout`.
    max_segments: M, the most segments (runs of one non-zero id) a row may hold.

  Returns:
    (lengths `[B, M]` int32, -1 past a row's last segment; offsets `[B, M + 1]` int32, each
    segment's first token, -1 past the last; fits `[B]` bool: the row has at most M runs and no id
    in two runs).
  """
  seg = layout.segment_ids
  b, t = seg.shape
  idx = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  new = jnp.concatenate([jnp.ones((b, 1), bool), seg[:, 1:] != seg[:, :-1]], axis=1)
  starts = new & (seg > 0)
  run = jnp.cumsum(starts, axis=1, dtype=jnp.int32) - 1
  slot = jnp.where((seg > 0) & (run < max_segments), run, max_segments)  # M = dropped
  rows = jnp.arange(b)[:, None]
  lengths = jnp.zeros((b, max_segments + 1), jnp.int32).at[rows, slot].add(1)[:, :max_segments]
  start_slot = jnp.where(starts, slot, max_segments)
  offsets = jnp.full((b, max_segments + 1), -1, jnp.int32).at[rows, start_slot].set(idx)
  offsets = offsets.at[:, max_segments].set(-1)
  runs = jnp.sum(starts, axis=1)
  contiguous = jnp.all(jnp.where(starts, layout.first == idx, True), axis=1)
  return jnp.where(lengths > 0, lengths, -1), offsets, (runs <= max_segments) & contiguous


def repeat_kv(k: jax.Array, v: jax.Array, groups: int) -> tuple[jax.Array, jax.Array]:
  """`[B, T, K, H]` keys and values as `[B, T, K * G, H]`: query head n reads head n // G."""
  return jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)


def cudnn_attention(q: jax.Array, k: jax.Array, v: jax.Array, layout: A.SegmentLayout, *,
                    max_segments: int) -> jax.Array:
  """Grouped-query self-attention over packed rows by cuDNN (module docstring).

  Args:
    q: `[B, T, N, H]` queries (bfloat16 / float16).
    k: `[B, T, K, H]` keys.
    v: `[B, T, K, H]` values.
    layout: the rows' `SegmentLayout` (no branch ids).
    max_segments: the most segments per row (>= 1; the packing's sequences per row).

  Returns:
    `[B, T, N, H]` in q's dtype; zero on padding rows, NaN on rows that break ``max_segments``.
  """
  b, t, n, h = q.shape
  why = unsupported(q.dtype, h, layout.branch_ids is not None)
  if why:
    raise ValueError(f"attention_impl='cudnn' cannot run this call: {why}")
  if max_segments < 1:
    raise ValueError(f"attention_impl='cudnn' needs Transformer max_segments >= 1 (the sequences a "
                     f"packed row holds, rollout.seqs_per_row), got {max_segments}: 0 would give "
                     f"every one of the {t} tokens a cuDNN segment slot")
  m = max(2, min(max_segments, t))  # 1 segment slot would not select the packed layout
  lengths, offsets, fits = packed_segments(layout, m)
  if k.shape[2] != n and not kv_offsets_use_kv_heads():
    k, v = repeat_kv(k, v, n // k.shape[2])
  out = _cudnn.dot_product_attention(
      q, k, v, q_seqlen=lengths, kv_seqlen=lengths, q_offsets=offsets, kv_offsets=offsets,
      scale=1.0 / math.sqrt(h), mask_type=_cudnn.MaskType.PADDING_CAUSAL, qkv_layout="BTNH")
  out = jnp.where((layout.segment_ids > 0)[:, :, None, None], out, 0)
  return jnp.where(fits[:, None, None, None], out, jnp.asarray(math.nan, out.dtype))
