"""`models.attention`: the written-out backward against autodiff of the value, causal blocks and
query chunks against one dense block (values and gradients), masked rows, and the model using
causal blocks only where its mask is causal."""

import dataclasses

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from flax import nnx

from disa_jax import scoring, testing
from disa_jax.models import attention, attention_xla

B, T, N, K, H = 2, 19, 4, 2, 8


def _inputs(seed=0, dtype=jnp.float32, t=T):
  rng = np.random.default_rng(seed)
  shapes = ((B, t, N, H), (B, t, K, H), (B, t, K, H))
  q, k, v = (jnp.asarray(rng.normal(size=s), dtype) for s in shapes)
  return q, k, v, jnp.asarray(rng.normal(size=(B, t, N, H)), jnp.float32)


def _packed_causal_mask(t=T):
  """Causal and within-segment: row 0 holds segments of 7, 5 and 5 tokens then 2 padding tokens
  (segment 0: those query rows have no allowed key); row 1 is one segment."""
  seg = np.zeros((B, t), np.int32)
  seg[0, :7], seg[0, 7:12], seg[0, 12:17] = 1, 2, 3
  seg[1] = 1
  same = (seg[:, :, None] == seg[:, None, :]) & (seg[:, None, :] > 0)
  return jnp.asarray(np.tril(np.ones((t, t), bool))[None] & same), seg > 0


def _value_and_grads(fn, q, k, v, mask, weights):
  loss = lambda q, k, v: jnp.sum(fn(q, k, v, mask).astype(jnp.float32) * weights)
  return jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)


def _assert_close(a, b, tol):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
    np.testing.assert_allclose(x, y, atol=tol * max(1.0, np.abs(y).max()))


def test_written_out_backward_equals_autodiff_of_the_value():
  """dQ, dK, dV of `_attend` against autodiff of its own value, with padding rows that attend to
  nothing (their dS must be zero, as the `where` makes it under autodiff)."""
  q, k, v, w = _inputs()
  mask, _ = _packed_causal_mask()
  got = _value_and_grads(attention._attend, q, k, v, mask, w)
  want = _value_and_grads(attention._attend.fun, q, k, v, mask, w)
  _assert_close(got, want, 1e-5)
  jitted = jax.jit(lambda *a: _value_and_grads(attention._attend, *a))(q, k, v, mask, w)
  _assert_close(jitted, want, 1e-5)


def test_bfloat16_backward_stays_close_to_float32_and_keeps_the_dtypes():
  q, k, v, w = _inputs(seed=1)
  mask, _ = _packed_causal_mask()
  want = _value_and_grads(attention._attend.fun, q, k, v, mask, w)
  lo = [x.astype(jnp.bfloat16) for x in (q, k, v)]
  got = _value_and_grads(attention._attend, *lo, mask, w)
  assert [g.dtype for g in got[1]] == [jnp.bfloat16] * 3
  _assert_close(got, want, 5e-2)


def test_causal_bounds_cover_the_rows_in_few_large_blocks(monkeypatch):
  assert attention.causal_block_bounds(100) == [(0, 100)]  # T <= CAUSAL_BLOCK: one block
  assert attention.causal_block_bounds(512) == [(0, 128), (128, 256), (256, 384), (384, 512)]
  for t in (129, 1000, 4097):
    bounds = attention.causal_block_bounds(t)
    assert bounds[0][0] == 0 and bounds[-1][1] == t
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    assert len(bounds) <= attention.MAX_CAUSAL_BLOCKS
    assert all(hi - lo >= attention.CAUSAL_BLOCK for lo, hi in bounds[:-1])


def test_causal_blocks_equal_one_dense_block_on_packed_rows(monkeypatch):
  """4-row blocks over 19 rows (5 blocks, the last of 3 rows): real rows' values and all gradients
  agree with the dense core; padding rows (no allowed key) stay finite."""
  monkeypatch.setattr(attention, "CAUSAL_BLOCK", 4)
  assert len(attention.causal_block_bounds(T)) == 5
  q, k, v, w = _inputs(seed=2)
  mask, real = _packed_causal_mask()
  w = w * real[:, :, None, None]  # the padding rows' outputs are never read
  blocked = lambda *a: attention.gqa_attention(*a, causal=True)
  got = _value_and_grads(blocked, q, k, v, mask, w)
  want = _value_and_grads(attention._attend, q, k, v, mask, w)
  _assert_close(got, want, 1e-5)
  out = np.asarray(blocked(q, k, v, mask))
  np.testing.assert_allclose(out[real], np.asarray(attention._attend(q, k, v, mask))[real],
                             atol=1e-5)
  assert np.isfinite(out).all()


def test_query_chunks_equal_one_dense_block():
  q, k, v, w = _inputs(seed=3)
  mask, real = _packed_causal_mask()
  w = w * real[:, :, None, None]
  chunked = lambda *a: attention.gqa_attention(*a, query_chunk=8)  # 19 rows: the last block padded
  _assert_close(_value_and_grads(chunked, q, k, v, mask, w),
                _value_and_grads(attention._attend, q, k, v, mask, w), 1e-5)


def test_causal_attention_needs_as_many_keys_as_queries():
  q, k, v, _ = _inputs()
  mask = jnp.ones((B, T, T + 3), bool)
  k3, v3 = (jnp.pad(x, ((0, 0), (0, 3), (0, 0), (0, 0))) for x in (k, v))
  with pytest.raises(ValueError, match=r"causal attention needs as many keys as queries.*"
                                       r"\(2, 22, 2, 8\)"):
    attention.gqa_attention(q, k3, v3, mask, causal=True)


@pytest.mark.slow
def test_the_model_runs_causal_blocks_on_packed_rows_and_dense_attention_with_a_cache(monkeypatch):
  """With 4-row causal blocks, packed rows' log-probs and gradients equal those of one block, and
  the cache path (keys != queries) still decodes: the model passes causal=True only without a
  cache. ('xla' by name: 'auto' runs rows this short dense on a CPU.)"""
  model = testing.make_tiny_model("qwen3", seed=5)
  model.options = dataclasses.replace(model.options, attention_impl="xla")
  rng = np.random.default_rng(4)
  ids = jnp.asarray(rng.integers(3, 120, size=(2, 19)), jnp.int32)
  seg = jnp.asarray(np.where(np.arange(19) < 8, 1, 2)[None].repeat(2, 0), jnp.int32)

  def run():
    f = lambda m: jnp.sum(scoring.token_logprobs(m, ids, segment_ids=seg))
    return nnx.value_and_grad(f)(model)

  one_block = run()
  monkeypatch.setattr(attention, "CAUSAL_BLOCK", 4)
  schedules = []
  pairs = attention_xla.pair_schedule
  monkeypatch.setattr(attention_xla, "pair_schedule",
                      lambda *a, **k: schedules.append(pairs(*a, **k)) or schedules[-1])
  blocked = run()
  # 19 tokens in 5 blocks of 4 (the last padded): the 15 causal (query, key) block pairs
  assert {(size, len(p)) for size, p in schedules} == {(4, 15)} and schedules
  _assert_close(jax.tree.leaves(blocked), jax.tree.leaves(one_block), 1e-5)
  calls = []
  dense = attention._attend
  monkeypatch.setattr(attention, "_attend", lambda *a: calls.append(a[0].shape) or dense(*a))
  cache = model.init_cache(2, 24)
  kv_mask = jnp.ones((2, 24), bool).at[:, 19:].set(False)
  model.forward_with_cache(ids, jnp.broadcast_to(jnp.arange(19), (2, 19)), cache, 0, kv_mask)
  assert [shape[1] for shape in calls] == [19] * model.config.num_layers  # one dense block each
