"""The Pallas flash-attention kernels (`attention_pallas`), run by the Pallas interpreter on a CPU:
values and gradients equal the dense reference to 1e-6 in float32 on packed, padded and
shared-prompt rows with grouped-query heads, and the blocks a kernel visits follow the segments
(run-time skipping), not the causal triangle."""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from disa_jax.models import attention_pallas

from .attention_cases import (CASES, REL_TOL, T, layout, max_rel_err, qkv,
                              reference_value_and_grads, value_and_grads)


@pytest.mark.parametrize("case", sorted(CASES))
def test_kernels_equal_the_dense_reference(case):
  """8-row query blocks over 4-row key blocks (T = 24 -> 3 x 6 tiles), 4 query heads per key/value
  head; every row weighted, so padding rows must give zero and pass no gradient."""
  seg, br = CASES[case]()
  lay = layout(seg, br)
  q, k, v, w = qkv(seed=2)
  flash = lambda q, k, v: attention_pallas.pallas_attention(q, k, v, lay, block_q=8, block_k=4,
                                                            interpret=True)
  got = jax.jit(lambda *a: value_and_grads(flash, *a))(q, k, v, w)
  want = reference_value_and_grads(lay, q, k, v, w)
  assert max_rel_err(got, want) <= REL_TOL
  assert np.all(np.asarray(flash(q, k, v))[seg == 0] == 0)


def test_rows_padded_to_the_block_and_bfloat16():
  """T = 21 with 8-row blocks (padded to 24); bfloat16 stays within bfloat16 rounding of the
  float32 reference and keeps the dtypes."""
  seg, _ = CASES["short"]()
  seg = seg[:, :21]
  lay = layout(seg)
  q, k, v, w = qkv(seed=3, t=21)
  want = reference_value_and_grads(lay, q, k, v, w)
  lo = [x.astype(jnp.bfloat16) for x in (q, k, v)]
  flash = lambda q, k, v: attention_pallas.pallas_attention(q, k, v, lay, block_q=8, block_k=8,
                                                            interpret=True)
  got = jax.jit(lambda *a: value_and_grads(flash, *a))(*lo, w)
  assert [g.dtype for g in got[1]] == [jnp.bfloat16] * 3
  assert max_rel_err(got, want) <= 3e-2


_NO = attention_pallas._NONE // 8  # pylint: disable=protected-access  (a block with no query)


def _ranges(seg, block):
  cfg = attention_pallas.PallasConfig(block, block, True, False)
  lay = layout(seg)
  n = seg.shape[1] // block
  fwd = [tuple(int(x) for x in attention_pallas._key_range(  # pylint: disable=protected-access
      lay.segment_ids[0, i * block:(i + 1) * block], lay.first[0, i * block:(i + 1) * block],
      i, cfg)) for i in range(n)]
  bwd = [tuple(int(x) for x in attention_pallas._query_range(  # pylint: disable=protected-access
      lay.segment_ids[0, j * block:(j + 1) * block], lay.last[0, j * block:(j + 1) * block],
      j, cfg)) for j in range(n)]
  return fwd, bwd


def test_visited_blocks_follow_the_segments():
  """64 tokens in 8-row blocks. Segments of 8 aligned to the blocks: each block visits itself only
  (8 tiles instead of the causal 36). Segments of 12: a block reaches back to its earliest
  segment's start. Padding blocks visit nothing."""
  seg = np.repeat(np.arange(1, 9), 8)[None].astype(np.int32)
  fwd, bwd = _ranges(seg, 8)
  assert fwd == [(i, i + 1) for i in range(8)] and bwd == [(j, j + 1) for j in range(8)]
  seg = np.zeros((1, 64), np.int32)
  seg[0, :48] = np.repeat(np.arange(1, 5), 12)  # 4 segments of 12, then 16 padding
  fwd, bwd = _ranges(seg, 8)
  assert fwd[:6] == [(0, 1), (0, 2), (1, 3), (3, 4), (3, 5), (4, 6)]
  assert fwd[6:] == [(_NO, 0)] * 2
  assert bwd[:6] == [(0, 2), (1, 3), (2, 3), (3, 5), (4, 6), (5, 6)] and bwd[6:] == [(6, 0), (7, 0)]
  visited = sum(max(0, b - a) for a, b in fwd)
  assert visited == 10 < 6 * 7 // 2  # the causal triangle of the 6 real blocks: 21


def test_blocks_must_cover_the_row():
  q, k, v, _ = qkv()
  lay = layout(CASES["packed"]()[0][:, :T - 1])
  with pytest.raises(ValueError, match=r"one length.*\(2, 23\)"):
    attention_pallas.pallas_attention(q, k, v, lay, interpret=True)
