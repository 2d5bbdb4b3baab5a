"""Chunked scoring vs the naive [B, T, V] log-softmax path: values, gradients, masks."""

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from flax import nnx

from disa_jax import scoring, testing


@pytest.fixture(scope="module")
def model():
  return testing.make_tiny_model("qwen2", seed=5)


def _batch(b=3, t=11, seed=0):
  rng = np.random.default_rng(seed)
  ids = rng.integers(5, 120, size=(b, t)).astype(np.int32)
  mask = np.ones((b, t), np.int32)
  mask[0, :3] = 0  # left padding
  if b > 1:
    mask[1, -2:] = 0  # right padding
  return jnp.asarray(ids), jnp.asarray(mask)


@pytest.mark.parametrize("chunk_size", [pytest.param(1, marks=pytest.mark.slow), 7,
                                        pytest.param(30, marks=pytest.mark.slow), 4096, None])
def test_equals_naive(model, chunk_size):
  ids, mask = _batch()
  got = scoring.token_logprobs(model, ids, mask, chunk_size=chunk_size)
  ref = scoring.token_logprobs_naive(model, ids, mask)
  assert got.shape == (3, 11) and got.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=1e-5)
  # zeros at t = 0, at pads, and right after a pad (t - 1 not real)
  g = np.asarray(got)
  assert (g[:, 0] == 0).all() and (g[0, :4] == 0).all() and (g[1, -2:] == 0).all()
  assert (g[2, 1:] < 0).all()


def test_matches_explicit_softmax_probability(model):
  ids, mask = _batch(1, 6)
  logits = np.asarray(model(ids), np.float64)[0]
  expect = [logits[t - 1, ids[0, t]] - np.log(np.exp(logits[t - 1]).sum()) for t in range(1, 6)]
  got = np.asarray(scoring.token_logprobs(model, ids, jnp.ones_like(ids), chunk_size=4))[0, 1:]
  np.testing.assert_allclose(got, expect, atol=1e-5)


def test_gradient_equals_naive_gradient(model):
  ids, mask = _batch()
  weights = jnp.asarray(np.random.default_rng(1).normal(size=ids.shape), jnp.float32)

  def loss(fn):
    return lambda m: jnp.sum(weights * fn(m))

  g_chunk = nnx.grad(loss(lambda m: scoring.token_logprobs(m, ids, mask, chunk_size=8)))(model)
  g_naive = nnx.grad(loss(lambda m: scoring.token_logprobs_naive(m, ids, mask)))(model)
  leaves_c, leaves_n = jax.tree.leaves(g_chunk), jax.tree.leaves(g_naive)
  assert len(leaves_c) == len(leaves_n) > 0
  for a, b in zip(leaves_c, leaves_n):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


def test_default_chunking_follows_the_logits_size(model, monkeypatch):
  """chunk_size=None: one chunk (no scan) while rows * V fits UNCHUNKED_MAX_ELEMENTS,
  DEFAULT_CHUNK_SIZE-row chunks in a scan beyond; values and gradients agree."""
  from disa_jax.scoring import logprobs as lp_mod
  ids, mask = _batch()
  vocab = model.config.vocab_size
  assert scoring.default_chunk_rows(30, vocab) == 30
  assert scoring.default_chunk_rows(scoring.UNCHUNKED_MAX_ELEMENTS // vocab + 1, vocab) == (
      scoring.DEFAULT_CHUNK_SIZE)
  weights = jnp.asarray(np.random.default_rng(2).normal(size=ids.shape), jnp.float32)
  loss = lambda m: jnp.sum(weights * scoring.token_logprobs(m, ids, mask))
  trace = lambda: str(jax.make_jaxpr(lambda h: scoring.logprobs_from_hidden(
      h, model.lm_head_kernel(), ids, mask))(model.hidden_states(ids, attention_mask=mask)))
  single_lp, single_g, single_jaxpr = scoring.token_logprobs(model, ids, mask), nnx.grad(loss)(
      model), trace()
  monkeypatch.setattr(lp_mod, "UNCHUNKED_MAX_ELEMENTS", 8 * vocab)  # 30 rows no longer fit
  monkeypatch.setattr(lp_mod, "DEFAULT_CHUNK_SIZE", 4)
  chunked_lp, chunked_g, chunked_jaxpr = scoring.token_logprobs(model, ids, mask), nnx.grad(loss)(
      model), trace()
  assert "scan" not in single_jaxpr and "scan" in chunked_jaxpr
  np.testing.assert_allclose(np.asarray(single_lp), np.asarray(chunked_lp), atol=1e-5)
  for a, b in zip(jax.tree.leaves(single_g), jax.tree.leaves(chunked_g)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


@pytest.mark.slow  # ~14 s: eager and jitted scoring of every mode
def test_jit_equals_eager_and_masked_equals_sliced(model):
  ids, _ = _batch(2, 10, seed=3)
  mask = jnp.ones_like(ids).at[:, 7:].set(0)
  f = nnx.jit(lambda m, i, k: scoring.token_logprobs(m, i, k, chunk_size=5))
  masked = f(model, ids, mask)
  np.testing.assert_allclose(np.asarray(masked),
                             np.asarray(scoring.token_logprobs(model, ids, mask, chunk_size=5)),
                             atol=1e-6)
  sliced = scoring.token_logprobs(model, ids[:, :7], jnp.ones((2, 7), jnp.int32))
  np.testing.assert_allclose(np.asarray(masked[:, :7]), np.asarray(sliced), atol=1e-5)
  assert (np.asarray(masked[:, 7:]) == 0).all()


def test_sequence_logprob_sum_and_mean():
  lp = jnp.asarray([[0.0, -1.0, -2.0, -3.0], [0.0, -0.5, 0.0, 0.0]])
  resp = jnp.asarray([[0, 1, 1, 1], [0, 1, 0, 0]])
  np.testing.assert_allclose(np.asarray(scoring.sequence_logprob(lp, resp, False)), [-6.0, -0.5])
  np.testing.assert_allclose(np.asarray(scoring.sequence_logprob(lp, resp, True)), [-2.0, -0.5])
  empty = scoring.sequence_logprob(lp, jnp.zeros_like(resp), True)
  np.testing.assert_array_equal(np.asarray(empty), [0.0, 0.0])


def test_prompt_embeddings_masked_mean(model):
  ids, _ = _batch(2, 8, seed=4)
  pmask = jnp.asarray([[0, 0, 1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1, 0, 0]], jnp.int32)
  emb = scoring.prompt_embeddings(model, ids, pmask)
  assert emb.shape == (2, 64) and emb.dtype == jnp.float32
  hidden = np.asarray(model.hidden_states(ids, attention_mask=pmask))
  np.testing.assert_allclose(np.asarray(emb[0]), hidden[0, 2:5].mean(0), atol=1e-6)
  # the prompt alone (tokens after it dropped) gives the same embedding
  alone = scoring.prompt_embeddings(model, ids[1:2, :6], jnp.ones((1, 6), jnp.int32))
  np.testing.assert_allclose(np.asarray(alone[0]), np.asarray(emb[1]), atol=1e-5)


def test_bad_shapes_raise():
  with pytest.raises(ValueError, match="chunk_size must be >= 1"):
    scoring.logprobs_from_hidden(jnp.zeros((1, 3, 4)), jnp.zeros((4, 5)),
                                 jnp.zeros((1, 3), jnp.int32), jnp.ones((1, 3)), chunk_size=0)
  with pytest.raises(ValueError, match="must both be"):
    scoring.logprobs_from_hidden(jnp.zeros((1, 3, 4)), jnp.zeros((4, 5)),
                                 jnp.zeros((1, 2), jnp.int32), jnp.ones((1, 3)))
