"""`scoring.head.target_logprobs`: values and gradients against autodiff of log-softmax at the
targets, kept and recomputed logits alike; how many vocabulary matmuls each takes; bfloat16 rows;
and `logprobs_from_hidden` choosing between them by `SAVED_LOGITS_MAX_ELEMENTS`."""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from disa_jax import scoring
from disa_jax.scoring import head
from disa_jax.scoring import logprobs as lp_mod

C, R, D, V = 3, 5, 16, 40  # chunks, rows per chunk, hidden size, vocabulary


def _inputs(seed=0, dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  rows = jnp.asarray(rng.normal(size=(C, R, D)), dtype)
  kernel = jnp.asarray(rng.normal(size=(D, V)) * 0.5, dtype)
  targets = jnp.asarray(rng.integers(0, V, size=(C, R)), jnp.int32)
  weights = jnp.asarray(rng.normal(size=(C, R)), jnp.float32)
  return rows, targets, kernel, weights


def _reference(rows, targets, kernel):
  logits = jnp.einsum("crd,dv->crv", rows.astype(jnp.float32), kernel.astype(jnp.float32))
  return jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), targets[..., None], -1)[..., 0]


def _value_and_grads(fn, rows, targets, kernel, weights):
  return jax.value_and_grad(lambda r, k: jnp.sum(fn(r, targets, k) * weights), argnums=(0, 1))(
      rows, kernel)


@pytest.mark.parametrize("save", [True, False])
def test_values_and_gradients_equal_autodiff_of_log_softmax(save):
  rows, targets, kernel, weights = _inputs()
  fn = lambda r, t, k: head.target_logprobs(r, t, k, save)
  got = _value_and_grads(fn, rows, targets, kernel, weights)
  want = _value_and_grads(_reference, rows, targets, kernel, weights)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5)
  jitted = jax.jit(lambda *a: _value_and_grads(fn, *a))(rows, targets, kernel, weights)
  for a, b in zip(jax.tree.leaves(jitted), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("save,matmuls", [(True, 3), (False, 4)])
def test_kept_logits_take_three_vocabulary_matmuls_and_recomputed_ones_four(save, matmuls):
  """The forward's logits, then dh and dW; recomputing adds the logits again in the backward."""
  rows, targets, kernel, weights = _inputs()
  jaxpr = jax.make_jaxpr(lambda r, k: _value_and_grads(
      lambda r, t, k: head.target_logprobs(r, t, k, save), r, targets, k, weights))(rows, kernel)
  assert str(jaxpr).count("dot_general") == matmuls


def test_bfloat16_rows_get_bfloat16_gradients_close_to_float32():
  rows, targets, kernel, weights = _inputs(seed=1)
  want = _value_and_grads(_reference, rows, targets, kernel, weights)
  lo = rows.astype(jnp.bfloat16), kernel.astype(jnp.bfloat16)
  fn = lambda r, t, k: head.target_logprobs(r, t, k, True)
  value, (d_rows, d_kernel) = _value_and_grads(fn, lo[0], targets, lo[1], weights)
  assert d_rows.dtype == d_kernel.dtype == jnp.bfloat16
  np.testing.assert_allclose(float(value), float(want[0]), rtol=2e-2)
  for a, b in zip((d_rows, d_kernel), want[1]):
    b = np.asarray(b)
    np.testing.assert_allclose(np.asarray(a, np.float32), b, atol=3e-2 * np.abs(b).max())


def test_logprobs_from_hidden_keeps_the_logits_only_within_the_budget(monkeypatch):
  """Over 2 x 8 tokens (15 scored rows, V = 40) with 4-row chunks: within the budget the gradient
  has 3 vocabulary matmuls, beyond it 4; values and gradients agree."""
  rng = np.random.default_rng(2)
  hidden = jnp.asarray(rng.normal(size=(2, 8, D)), jnp.float32)
  kernel = jnp.asarray(rng.normal(size=(D, V)) * 0.5, jnp.float32)
  ids = jnp.asarray(rng.integers(0, V, size=(2, 8)), jnp.int32)
  mask = jnp.ones((2, 8), jnp.int32).at[1, 6:].set(0)

  def run():
    f = lambda h, k: jnp.sum(scoring.logprobs_from_hidden(h, k, ids, mask, chunk_size=4) ** 2)
    jaxpr = str(jax.make_jaxpr(jax.value_and_grad(f, argnums=(0, 1)))(hidden, kernel))
    return jaxpr.count("dot_general"), jax.value_and_grad(f, argnums=(0, 1))(hidden, kernel)

  kept_count, kept = run()
  monkeypatch.setattr(lp_mod, "SAVED_LOGITS_MAX_ELEMENTS", 16 * V - 1)  # 16 padded rows
  recomputed_count, recomputed = run()
  assert (kept_count, recomputed_count) == (3, 4)
  for a, b in zip(jax.tree.leaves(kept), jax.tree.leaves(recomputed)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
