"""The JAX sampler's token sampling: processed log-probs, one step's draw, per-row keys, buckets.

Shared by both decode paths of `disa_jax.rollout.jax_sampler` (the dense reference and the ragged,
continuously batched `disa_jax.rollout.continuous`). A row's token at column j is drawn with
``fold_in(key_row, j)``, where ``key_row = fold_in(fold_in(key(seed), p), s)`` for prompt p and
sample s, so a sample depends on neither the rest of the batch nor the slot or time it ran in.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_NEG_INF = -jnp.inf


def prompt_positions(prompt_mask: jax.Array) -> jax.Array:
  """`[B, T]` int32 position of each prompt token from its (left-padded) `[B, T]` mask: the count
  of real tokens before it (padding: 0)."""
  return jnp.maximum(jnp.cumsum(prompt_mask, axis=1) - 1, 0).astype(jnp.int32)


def bucket(n: int, minimum: int) -> int:
  """Smallest power of two >= max(n, minimum)."""
  return 1 << max(int(n - 1).bit_length(), int(minimum - 1).bit_length())


def process_logits(logits: jax.Array, temperature: jax.Array, top_k: jax.Array,
                   top_p: jax.Array) -> jax.Array:
  """Log-probs of the distribution actually sampled from.

  Scales by the temperature, keeps the `top_k` largest logits (0 = all), then the smallest set of
  most likely tokens whose probability reaches `top_p` (a token is kept if the mass of the tokens
  ranked above it is < top_p; the most likely token is always kept). Ties at a cut-off are kept.

  Args:
    logits: `[B, V]` float32 raw logits.
    temperature: scalar > 0 (callers substitute 1 for greedy).
    top_k: int32 scalar, 0 = off.
    top_p: float32 scalar in (0, 1].

  Returns:
    `[B, V]` float32 log-probs; -inf outside the kept set.
  """
  vocab = logits.shape[-1]
  scaled = logits.astype(jnp.float32) / temperature

  def truncate(scaled):
    sorted_desc = -jnp.sort(-scaled, axis=-1)  # [B, V]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    kth = jax.lax.dynamic_index_in_dim(sorted_desc, k - 1, axis=-1, keepdims=True)  # [B, 1]
    sorted_desc = jnp.where(sorted_desc >= kth, sorted_desc, _NEG_INF)
    probs = jax.nn.softmax(sorted_desc, axis=-1)
    mass_above = jnp.cumsum(probs, axis=-1) - probs  # [B, V]
    # Tokens cut by top-k have probability 0 but their mass_above may round below 1.
    keep = (mass_above < top_p) & (sorted_desc > _NEG_INF)
    cutoff = jnp.min(jnp.where(keep, sorted_desc, jnp.inf), axis=-1, keepdims=True)  # [B, 1]
    return jnp.where(scaled >= cutoff, scaled, _NEG_INF)

  scaled = jax.lax.cond((top_k > 0) | (top_p < 1.0), truncate, lambda s: s, scaled)
  return jax.nn.log_softmax(scaled, axis=-1)


def sample_step(logits: jax.Array, keys: jax.Array, step: jax.Array, temperature: jax.Array,
                top_k: jax.Array, top_p: jax.Array):
  """Samples one token per row.

  Args:
    logits: `[B, V]` raw logits.
    keys: `[B, 2]` uint32 per-row keys.
    step: int32 scalar or `[B]` (each row's own column), folded into the keys.

  Returns:
    (tokens `[B]` int32, processed log-probs `[B]` (0 for greedy), raw log-probs `[B]`).
  """
  logits = logits.astype(jnp.float32)
  greedy = temperature <= 0.0
  processed = process_logits(logits, jnp.where(greedy, 1.0, temperature), top_k, top_p)
  steps = jnp.broadcast_to(jnp.asarray(step, jnp.int32), keys.shape[:1])
  step_keys = jax.vmap(jax.random.fold_in)(keys, steps)
  sampled = jax.vmap(jax.random.categorical)(step_keys, processed)  # [B]
  tokens = jnp.where(greedy, jnp.argmax(logits, axis=-1), sampled).astype(jnp.int32)
  lp = jnp.take_along_axis(processed, tokens[:, None], axis=-1)[:, 0]
  raw = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), tokens[:, None], axis=-1)[:, 0]
  return tokens, jnp.where(greedy, 0.0, lp), raw


@jax.jit
def row_keys(seed: jax.Array, prompt_idx: jax.Array, sample_idx: jax.Array) -> jax.Array:
  """`[B, 2]` keys fold_in(fold_in(PRNGKey(seed), p), j)."""
  base = jax.random.PRNGKey(seed)
  return jax.vmap(lambda p, j: jax.random.fold_in(jax.random.fold_in(base, p), j))(
      prompt_idx, sample_idx)
