"""Teacher-forced per-token log-probabilities, chunked over tokens so [B, T, V] is never built.

The final hidden states `[B, T, D]` are flattened to `[B*T, D]` rows, split into chunks of
`chunk_size` rows, and each chunk's `[chunk, V]` logits are formed, reduced to
`logit[target] - logsumexp(logits)` in float32, and dropped. The chunk function is wrapped in
`jax.checkpoint`, so the backward pass recomputes a chunk's logits instead of storing them: peak
memory is O(chunk_size * V) in both directions. Everything is differentiable w.r.t. the model.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

DEFAULT_CHUNK_SIZE = 1024


def _shifted_mask(attention_mask: jax.Array) -> jax.Array:
  """`[B, T]` bool: position t is scored iff t >= 1 and tokens t and t-1 are both real."""
  m = attention_mask.astype(bool)
  return jnp.concatenate([jnp.zeros_like(m[:, :1]), m[:, 1:] & m[:, :-1]], axis=1)


def logprobs_from_hidden(hidden: jax.Array, kernel: jax.Array, input_ids: jax.Array,
                         attention_mask: jax.Array, *, chunk_size: int = DEFAULT_CHUNK_SIZE
                         ) -> jax.Array:
  """Per-token log-probs from final hidden states and the output projection.

  Args:
    hidden: `[B, T, D]` final-normed hidden states (any float dtype).
    kernel: `[D, V]` output projection.
    input_ids: `[B, T]` int tokens; `input_ids[:, t]` is scored from `hidden[:, t - 1]`.
    attention_mask: `[B, T]` (1 = real token, 0 = pad).
    chunk_size: rows of `[B*T, D]` per chunk (peak extra memory ~ chunk_size * V float32).

  Returns:
    `[B, T]` float32: log p(input_ids[:, t] | input_ids[:, <t]) where scored (see
    `_shifted_mask`), 0 elsewhere, including t = 0.
  """
  if chunk_size < 1:
    raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
  b, t, d = hidden.shape
  if input_ids.shape != (b, t) or attention_mask.shape != (b, t):
    raise ValueError(f"input_ids {input_ids.shape} and attention_mask {attention_mask.shape} must "
                     f"both be [B, T] = {(b, t)}")
  if t < 2:
    return jnp.zeros((b, t), jnp.float32)
  n = b * (t - 1)
  rows = hidden[:, :-1].reshape(n, d)  # [B, T-1, D] -> [N, D]; row b*(T-1)+i predicts token i+1
  targets = input_ids[:, 1:].reshape(n)  # [B, T-1] -> [N]
  chunk = min(chunk_size, n)
  n_chunks = -(-n // chunk)
  pad = n_chunks * chunk - n
  rows = jnp.pad(rows, ((0, pad), (0, 0))).reshape(n_chunks, chunk, d)  # [N, D] -> [C, c, D]
  targets = jnp.pad(targets, (0, pad)).reshape(n_chunks, chunk)  # [N] -> [C, c]
  kernel = kernel.astype(hidden.dtype)

  @jax.checkpoint
  def chunk_logprobs(h: jax.Array, tgt: jax.Array) -> jax.Array:
    logits = jnp.einsum("cd,dv->cv", h, kernel, preferred_element_type=jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, tgt[:, None], axis=-1)[:, 0]
    return picked - lse

  def body(carry, xs):
    return carry, chunk_logprobs(*xs)

  _, lp = jax.lax.scan(body, None, (rows, targets))
  lp = lp.reshape(n_chunks * chunk)[:n].reshape(b, t - 1)  # [C, c] -> [N] -> [B, T-1]
  lp = jnp.concatenate([jnp.zeros((b, 1), jnp.float32), lp], axis=1)
  return jnp.where(_shifted_mask(attention_mask), lp, 0.0)


def token_logprobs(model: Any, input_ids: jax.Array, attention_mask: jax.Array, *,
                   chunk_size: int = DEFAULT_CHUNK_SIZE) -> jax.Array:
  """Teacher-forced per-token log-probs of `input_ids` under `model` (a `Transformer`).

  Args:
    model: provides `hidden_states(ids, attention_mask=...)` and `lm_head_kernel()`.
    input_ids: `[B, T]` int tokens (left or right padding).
    attention_mask: `[B, T]` (1 = real token, 0 = pad).
    chunk_size: token rows per vocabulary chunk.

  Returns:
    `[B, T]` float32; out[:, t] = log p(input_ids[:, t] | input_ids[:, <t]) for t >= 1 where tokens
    t and t-1 are real, 0 elsewhere. Never materialises `[B, T, V]` float32; differentiable.
  """
  hidden = model.hidden_states(input_ids, attention_mask=attention_mask)
  return logprobs_from_hidden(hidden, model.lm_head_kernel(), input_ids, attention_mask,
                              chunk_size=chunk_size)


def token_logprobs_naive(model: Any, input_ids: jax.Array, attention_mask: jax.Array) -> jax.Array:
  """Reference: full `[B, T, V]` float32 log-softmax (for tests and benchmarks only)."""
  logits = model(input_ids, attention_mask=attention_mask).astype(jnp.float32)
  logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
  picked = jnp.take_along_axis(logp, input_ids[:, 1:, None], axis=-1)[..., 0]
  lp = jnp.concatenate([jnp.zeros((input_ids.shape[0], 1), jnp.float32), picked], axis=1)
  return jnp.where(_shifted_mask(attention_mask), lp, 0.0)


def sequence_logprob(token_lp: jax.Array, response_mask: jax.Array, normalize: bool) -> jax.Array:
  """Sequence log-prob over response tokens.

  Args:
    token_lp: `[B, T]` per-token log-probs (entries outside the mask are ignored, even if -inf/NaN).
    response_mask: `[B, T]` (1 = response token).
    normalize: False -> sum (the trajectory log-prob); True -> mean over response tokens
      (the 1/|y| length-normalised form; 0 for an empty response).

  Returns:
    `[B]` float32.
  """
  m = response_mask > 0
  total = jnp.sum(jnp.where(m, token_lp.astype(jnp.float32), 0.0), axis=-1)
  if not normalize:
    return total
  return total / jnp.maximum(jnp.sum(m, axis=-1).astype(jnp.float32), 1.0)


def prompt_embeddings(model: Any, input_ids: jax.Array, prompt_mask: jax.Array) -> jax.Array:
  """Masked mean of the final-normed hidden state over prompt tokens (Stage 2 anchor input).

  Args:
    model: provides `hidden_states`.
    input_ids: `[B, T]` tokens (prompt, possibly followed by more tokens; causal attention makes
      prompt states independent of what follows).
    prompt_mask: `[B, T]` (1 = prompt token); also used as the attention mask.

  Returns:
    `[B, D]` float32 (zeros for a row without prompt tokens).
  """
  hidden = model.hidden_states(input_ids, attention_mask=prompt_mask).astype(jnp.float32)
  m = prompt_mask.astype(jnp.float32)[..., None]  # [B, T] -> [B, T, 1]
  return jnp.sum(hidden * m, axis=1) / jnp.maximum(jnp.sum(m, axis=1), 1.0)
