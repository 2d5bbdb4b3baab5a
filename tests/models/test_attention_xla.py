"""`attention.SegmentLayout` and the block-sparse XLA attention (`attention_xla`): the layout's mask
is the model's former one, the blocked path equals the dense reference (values and gradients, to
1e-6 in float32) on packed, padded and shared-prompt rows with grouped-query heads, with and
without a band and query chunks, and its compiled FLOPs follow sum(segment^2), not T^2."""

import dataclasses
import numpy as np
import pytest

import jax

from disa_jax.models import attention, attention_xla
from disa_jax.parallel import hlo_facts

from .attention_cases import (B, CASES, REL_TOL, layout, max_rel_err, packed_ids, qkv,
                              reference_value_and_grads, value_and_grads)


def _old_mask(seg, br=None):
  """The `[B, T, T]` mask `Transformer._full_mask` built before layouts (written out here)."""
  t = seg.shape[1]
  same = (seg[:, :, None] == seg[:, None, :]) & (seg[:, None, :] > 0)
  if br is not None:
    same &= (br[:, None, :] == 0) | (br[:, None, :] == br[:, :, None])
  return np.tril(np.ones((t, t), bool))[None] & same


def test_layout_extents_and_mask():
  seg = np.array([[1, 1, 2, 2, 2, 0, 0], [3, 3, 3, 0, 1, 1, 0]], np.int32)  # ids need not be runs
  lay = layout(seg)
  np.testing.assert_array_equal(lay.first, [[0, 0, 2, 2, 2, 5, 5], [0, 0, 0, 3, 4, 4, 3]])
  np.testing.assert_array_equal(lay.last, [[1, 1, 4, 4, 4, 6, 6], [2, 2, 2, 6, 5, 5, 6]])
  np.testing.assert_array_equal(attention.segment_span(lay),
                                [[1, 2, 1, 2, 3, 0, 0], [1, 2, 3, 0, 1, 2, 0]])
  for make in CASES.values():
    seg, br = make()
    np.testing.assert_array_equal(attention.dense_mask(layout(seg, br)), _old_mask(seg, br))
    np.testing.assert_array_equal(attention.layout_mask(layout(seg, br), 5, 17, 2, 20),
                                  _old_mask(seg, br)[:, 5:17, 2:20])


def test_pair_schedule_covers_the_causal_band():
  assert attention_xla.pair_schedule(100) == (128, [(0, 0)])  # <= CAUSAL_BLOCK: one block
  assert attention_xla.pair_schedule(512) == (128, [(i, j) for i in range(4) for j in range(i + 1)])
  size, band = attention_xla.pair_schedule(1024, window=128)
  assert size == 32  # w / 4
  assert all(i - 4 <= j <= i for i, j in band) and (8, 4) in band and (8, 3) not in band
  assert attention_xla.pair_schedule(40, chunk=16) == (16, [(0, 0), (1, 0), (1, 1), (2, 0), (2, 1),
                                                            (2, 2)])
  # window 10: query block 1 (tokens 16..31) reaches back to token 7 (block 0); block 2 to 23
  assert attention_xla.pair_schedule(40, window=10, chunk=16)[1] == [(0, 0), (1, 0), (1, 1),
                                                                      (2, 1), (2, 2)]


def test_one_rolled_loop_whatever_the_blocks():
  """The forward and backward are one loop each over the live pairs (issue 66: the former
  Python-unrolled blocks grew the program, and its compile time, with the number of blocks)."""
  seg = _equal_segments(1024, 8)
  q, k, v, _ = qkv(t=1024, n=2, kv=1, h=16)
  loss = lambda q, k, v, lay: jax.numpy.sum(attention_xla.xla_attention(q, k, v, lay, chunk=64))
  text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v, layout(seg)).compile().as_text()
  loops = hlo_facts.read_module(text).while_loops
  pairs = len(attention_xla.pair_schedule(1024, chunk=64)[1])
  assert pairs == 136 and sorted(w.trip_count for w in loops) == [pairs, pairs]


@pytest.mark.parametrize("case,band,chunk", [("packed", False, 0), ("short", True, 0),
                                             ("short", True, 4), ("branches", False, 8),
                                             ("branches", True, 0)])
def test_blocked_equals_dense(monkeypatch, case, band, chunk):
  """Unequal segments with padding (every row weighted: padding rows must give zero and pass no
  gradient), or shared prompts; 4-row causal blocks, the band at the longest segment (12 tokens:
  it cuts keys off), 4- and 8-row blocks given as chunks."""
  monkeypatch.setattr(attention, "CAUSAL_BLOCK", 4)
  monkeypatch.setattr(attention_xla, "MIN_BAND_BLOCK", 4)
  seg, br = CASES[case]()
  lay = layout(seg, br)
  window = int(np.max(attention.segment_span(lay))) if band else 0
  pairs = attention_xla.pair_schedule(seg.shape[1], window=window, chunk=chunk)[1]
  assert not band or any((i, 0) not in pairs for i, _ in pairs)  # the band cuts keys off
  q, k, v, w = qkv(seed=1)
  blocked = lambda lay: lambda q, k, v: attention_xla.xla_attention(q, k, v, lay, window=window,
                                                                   chunk=chunk)
  got = jax.jit(lambda lay, *a: value_and_grads(blocked(lay), *a))(lay, q, k, v, w)
  assert max_rel_err(got, reference_value_and_grads(lay, q, k, v, w)) <= REL_TOL
  out = jax.jit(lambda lay, q, k, v: blocked(lay)(q, k, v))(lay, q, k, v)
  assert out.dtype == q.dtype and np.all(np.asarray(out)[seg == 0] == 0)


def test_a_row_longer_than_the_band_gets_nan():
  seg = packed_ids()
  q, k, v, _ = qkv()
  out = np.asarray(attention_xla.xla_attention(q, k, v, layout(seg), window=9))
  assert np.isfinite(out[0]).all() and np.isnan(out[1]).all()  # row 1 holds 20 tokens


def _compiled_flops(seg, window):
  q, k, v, _ = qkv(t=seg.shape[1], n=1, kv=1, h=16)
  fn = jax.jit(lambda q, k, v, lay: attention_xla.xla_attention(q, k, v, lay, window=window))
  return hlo_facts.read_module(fn.lower(q, k, v, layout(seg)).compile().as_text()).dot_flops


def _equal_segments(t, n):
  seg = np.zeros((B, t), np.int32)
  seg[:] = np.repeat(np.arange(1, n + 1), t // n)[None]
  return seg


def test_compiled_flops_follow_the_segments_not_the_row():
  """T = 1024 tokens as one segment or as 8 equal ones (the band at their length): XLA's own FLOP
  count of the compiled attention. One segment is the causal triangle, T^2 / 2; 8 segments cost
  T (w - 1 + b) ~ 2 sum(segment^2) (`attention_xla`: a static band cannot skip the causal half of
  each segment), ~T / (2 w) = 4x less, 3.9x with its w / 4-row blocks, as the schedule counts.
  Along the schedule the cost is linear in the segment length at a fixed T (sum(segment^2) = T w):
  4 segments cost 1.9x what 8 do."""
  t = 1024
  one = _compiled_flops(_equal_segments(t, 1), 0)
  eight = _compiled_flops(_equal_segments(t, 8), 128)
  model = lambda w, t=t: attention_xla.attention_flops(t, batch=B, heads=1, head_dim=16, window=w)
  assert one / eight == pytest.approx(model(0) / model(128), rel=0.05)
  assert one / eight > 3.6
  assert 1.8 < model(256) / model(128) < 2.0
  assert 1.85 < model(2048, 16384) / model(1024, 16384) < 2.05  # 8 vs 16 segments of a long row


def _train_step_flops(impl, t, segment=128):
  """XLA's FLOP count of the compiled loss and parameter gradients of a one-layer tiny Qwen3
  (small vocabulary and MLP, so that the attention dominates) on one row of T tokens made of
  equal segments, the band ('xla') at their length."""
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from disa_jax import testing  # pylint: disable=import-outside-toplevel
  model = testing.make_tiny_model("qwen3", seed=11, num_layers=1, vocab_size=32,
                                  intermediate_size=32)
  model.options = dataclasses.replace(model.options, attention_impl=impl,
                                      max_segment_len=segment if impl == "xla" else 0)
  seg = jax.numpy.asarray(np.repeat(np.arange(1, t // segment + 1), segment)[None], np.int32)
  ids = (seg * 7) % 32
  graphdef, state = nnx.split(model)

  def loss(state, ids, seg):
    logits = nnx.merge(graphdef, state)(ids, segment_ids=seg)
    return -jax.numpy.mean(jax.numpy.take_along_axis(jax.nn.log_softmax(logits)[:, :-1],
                                                     ids[:, 1:, None], axis=-1))

  step = jax.jit(jax.value_and_grad(loss))
  return hlo_facts.read_module(step.lower(state, ids, seg).compile().as_text()).dot_flops


@pytest.mark.slow
def test_compiled_train_step_flops_follow_the_segments_not_the_row():
  """The whole model's loss and gradients through `Transformer` (not the attention alone): rows
  of T = 256 and 1024 tokens of 128-token segments. With 'xla' and the band the FLOPs grow about
  linearly in T (sum(segment^2) = T x 128: ratio ~4.9, the T^2 ratio being 16); 'dense' grows
  ~T^2 in its attention (ratio ~8.4 with the linear rest of the model). Matmul FLOPs with each
  loop body counted per trip (`hlo_facts`: XLA's cost analysis counts the 'xla' loop once)."""
  xla = [_train_step_flops("xla", t) for t in (256, 1024)]
  dense = [_train_step_flops("dense", t) for t in (256, 1024)]
  print(f"train-step FLOPs, T=256 / 1024: xla {xla}, dense {dense}")
  assert xla[1] / xla[0] < 5.5  # linear (4) plus the band's edges; T^2 would be 16
  assert dense[1] / dense[0] > 7.5
  assert xla[1] < 0.5 * dense[1]
