"""The vocabulary head's log-softmax at the target tokens, over row chunks, with its backward
written out.

For hidden rows h `[N, D]`, the head's kernel W `[D, V]` and targets y `[N]`:

    lp_i = (h_i W)[y_i] - logsumexp(h_i W)

in float32, the rows taken `c` at a time so that at most `[c, V]` logits are live in the forward
pass. For an upstream cotangent g `[N]` the backward pass is, per chunk,

    dlogits = g * (onehot(y) - softmax(h W)),   dh = dlogits W^T,   dW += h^T dlogits.

The softmax needs the chunk's logits again. They are either kept from the forward pass
(``save_logits``: three vocabulary matmuls in all, `[N, V]` float32 held from the forward to the
backward pass), or recomputed chunk by chunk (four matmuls, `[c, V]` live). `logprobs_from_hidden`
keeps them while `N * V <= SAVED_LOGITS_MAX_ELEMENTS`. The target logit is gathered in the forward
pass, and the one-hot term is a select inside the backward's single pass over the chunk (no
`[N, V]` index array, no scatter).

Autodiff of the checkpointed chunk, which this replaced, recomputed the logits whatever their size
and built a `[N, V]` iota for a one-hot pick. The d=512 head's fwd+bwd (4,096 rows in 4 chunks,
V = 32,000, float32, 2-core CPU, medians of 7): 3.38 s that way; 2.41 s with kept logits, 3.16 s
recomputed (`benchmarks/bench_models_speed.py` times the whole train step).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp

# Kept logits (`save_logits`) while rows * V <= this: 2**27 float32 = 512 MiB.
SAVED_LOGITS_MAX_ELEMENTS = 1 << 27


def _over_chunks(fn: Callable, carry: Any, xs: Any) -> tuple[Any, Any]:
  """`jax.lax.scan(fn, carry, xs)`; a single chunk is a plain call (no loop in the program)."""
  if jax.tree.leaves(xs)[0].shape[0] > 1:
    return jax.lax.scan(fn, carry, xs)
  carry, ys = fn(carry, jax.tree.map(lambda a: a[0], xs))
  return carry, jax.tree.map(lambda a: a[None], ys)


def _chunk_logits(h: jax.Array, kernel: jax.Array) -> jax.Array:
  """`[c, D]` rows -> `[c, V]` float32 logits."""
  return jnp.matmul(h, kernel, preferred_element_type=jnp.float32)


def _chunk_forward(h: jax.Array, tgt: jax.Array, kernel: jax.Array
                   ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """`[c, D]` rows, `[c]` targets -> (`[c]` log-probs, `[c]` logsumexp, `[c, V]` logits)."""
  logits = _chunk_logits(h, kernel)
  lse = jax.nn.logsumexp(logits, axis=-1)
  picked = jnp.take_along_axis(logits, tgt[:, None], axis=-1)[:, 0]
  return picked - lse, lse, logits


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def target_logprobs(rows: jax.Array, targets: jax.Array, kernel: jax.Array,
                    save_logits: bool) -> jax.Array:
  """Per-row log-softmax of the head at the targets (see the module docstring).

  Args:
    rows: `[C, c, D]` hidden rows in C chunks of c.
    targets: `[C, c]` int token ids, each in [0, V).
    kernel: `[D, V]` the head, in the rows' dtype.
    save_logits: in the backward pass, reuse the forward's `[C, c, V]` float32 logits (True) or
      recompute them chunk by chunk (False). The values are the same either way.

  Returns:
    `[C, c]` float32 log p(target | row).
  """
  _, lp = _over_chunks(lambda _, xs: (None, _chunk_forward(*xs, kernel)[0]), None, (rows, targets))
  return lp


def _target_logprobs_fwd(rows, targets, kernel, save_logits):
  def chunk(_, xs):
    lp, lse, logits = _chunk_forward(*xs, kernel)
    return None, (lp, lse, logits if save_logits else None)

  _, (lp, lse, logits) = _over_chunks(chunk, None, (rows, targets))
  return lp, (rows, targets, kernel, lse, logits)


def _target_logprobs_bwd(save_logits, res, g):
  rows, targets, kernel, lse, saved = res
  kernel32 = kernel.astype(jnp.float32)

  def chunk(dw, xs):
    h, tgt, lse_c, g_c = xs[:4]
    logits = xs[4] if save_logits else _chunk_logits(h, kernel)
    vocab = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 1)
    weighted = g_c[:, None] * jnp.exp(logits - lse_c[:, None])
    dlogits = jnp.where(vocab == tgt[:, None], g_c[:, None] - weighted, -weighted)  # [c, V]
    dh = jnp.matmul(dlogits, kernel32.T).astype(h.dtype)
    return dw + jnp.matmul(h.astype(jnp.float32).T, dlogits), dh

  xs = (rows, targets, lse, g) + ((saved,) if save_logits else ())
  dw, drows = _over_chunks(chunk, jnp.zeros(kernel.shape, jnp.float32), xs)
  return drows, None, dw.astype(kernel.dtype)


target_logprobs.defvjp(_target_logprobs_fwd, _target_logprobs_bwd)
