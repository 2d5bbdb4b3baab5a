"""Teacher-forced per-token log-probabilities, chunked over tokens when `[B, T, V]` would be large.

The final hidden states `[B, T, D]` are flattened to `[B*T, D]` rows, and each row's logits are
reduced to `logit[target] - logsumexp(logits)` in float32. When all rows' logits are small (at
most `UNCHUNKED_MAX_ELEMENTS`, e.g. a small vocabulary) they are computed in one piece. Otherwise
the rows are split into chunks of `chunk_size` rows processed by a `lax.scan` whose chunk function
is wrapped in `jax.checkpoint`: the backward pass recomputes a chunk's logits instead of storing
them, and peak memory is O(chunk_size * V) in both directions. Chunking pays only for a large V:
for a small one the scan and the recomputation cost more than the logits' memory. Everything is
differentiable w.r.t. the model.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

DEFAULT_CHUNK_SIZE = 1024  # rows per chunk when the logits are chunked
# chunk_size=None: no chunking while rows * V <= this (2**25 float32 logits = 128 MiB).
UNCHUNKED_MAX_ELEMENTS = 1 << 25


def _shifted_mask(attention_mask: jax.Array) -> jax.Array:
  """`[B, T]` bool: position t is scored iff t >= 1 and tokens t and t-1 are both real."""
  m = attention_mask.astype(bool)
  return jnp.concatenate([jnp.zeros_like(m[:, :1]), m[:, 1:] & m[:, :-1]], axis=1)


def default_chunk_rows(rows: int, vocab_size: int) -> int:
  """Rows per chunk for `chunk_size=None`: all `rows` (one chunk, no recomputation) when
  `rows * vocab_size <= UNCHUNKED_MAX_ELEMENTS`, else `DEFAULT_CHUNK_SIZE`."""
  return rows if rows * vocab_size <= UNCHUNKED_MAX_ELEMENTS else DEFAULT_CHUNK_SIZE


def _rows_logprobs(h: jax.Array, tgt: jax.Array, kernel: jax.Array) -> jax.Array:
  """`[c, D]` hidden rows and `[c]` targets -> `[c]` float32 log-softmax at the targets.

  The target logit is picked with a one-hot mask in the same pass as the logsumexp (no gather, and
  a select instead of a scatter in the backward pass).
  """
  logits = jnp.einsum("cd,dv->cv", h, kernel, preferred_element_type=jnp.float32)
  lse = jax.nn.logsumexp(logits, axis=-1)
  vocab = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 1)
  picked = jnp.sum(jnp.where(vocab == tgt[:, None], logits, 0.0), axis=-1)
  return picked - lse


def logprobs_from_hidden(hidden: jax.Array, kernel: jax.Array, input_ids: jax.Array,
                         attention_mask: jax.Array, *, chunk_size: int | None = None
                         ) -> jax.Array:
  """Per-token log-probs from final hidden states and the output projection.

  Args:
    hidden: `[B, T, D]` final-normed hidden states (any float dtype).
    kernel: `[D, V]` output projection.
    input_ids: `[B, T]` int tokens; `input_ids[:, t]` is scored from `hidden[:, t - 1]`.
    attention_mask: `[B, T]` (1 = real token, 0 = pad).
    chunk_size: rows of `[B*(T-1), D]` per chunk (peak extra memory ~ chunk_size * V float32);
      None: `default_chunk_rows(B*(T-1), V)`. When all rows fit in one chunk there is no chunking
      and no recomputation in the backward pass.

  Returns:
    `[B, T]` float32: log p(input_ids[:, t] | input_ids[:, <t]) where scored (see
    `_shifted_mask`), 0 elsewhere, including t = 0.
  """
  if chunk_size is not None and chunk_size < 1:
    raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
  b, t, d = hidden.shape
  if input_ids.shape != (b, t) or attention_mask.shape != (b, t):
    raise ValueError(f"input_ids {input_ids.shape} and attention_mask {attention_mask.shape} must "
                     f"both be [B, T] = {(b, t)}")
  if t < 2:
    return jnp.zeros((b, t), jnp.float32)
  with jax.named_scope("logprobs"):  # names the ops in profiles
    return _chunked_logprobs(hidden, kernel, input_ids, attention_mask, chunk_size)


def _chunked_logprobs(hidden: jax.Array, kernel: jax.Array, input_ids: jax.Array,
                      attention_mask: jax.Array, chunk_size: int | None) -> jax.Array:
  """`logprobs_from_hidden` after its checks (T >= 2)."""
  b, t, d = hidden.shape
  n = b * (t - 1)
  rows = hidden[:, :-1].reshape(n, d)  # [B, T-1, D] -> [N, D]; row b*(T-1)+i predicts token i+1
  targets = input_ids[:, 1:].reshape(n)  # [B, T-1] -> [N]
  kernel = kernel.astype(hidden.dtype)
  chunk = min(chunk_size or default_chunk_rows(n, kernel.shape[1]), n)
  if chunk == n:
    lp = _rows_logprobs(rows, targets, kernel)
  else:
    n_chunks = -(-n // chunk)
    pad = n_chunks * chunk - n
    rows = jnp.pad(rows, ((0, pad), (0, 0))).reshape(n_chunks, chunk, d)  # [N, D] -> [C, c, D]
    targets = jnp.pad(targets, (0, pad)).reshape(n_chunks, chunk)  # [N] -> [C, c]
    chunk_logprobs = jax.checkpoint(lambda h, tgt: _rows_logprobs(h, tgt, kernel))
    _, lp = jax.lax.scan(lambda carry, xs: (carry, chunk_logprobs(*xs)), None, (rows, targets))
    lp = lp.reshape(n_chunks * chunk)[:n]  # [C, c] -> [N]
  lp = jnp.concatenate([jnp.zeros((b, 1), jnp.float32), lp.reshape(b, t - 1)], axis=1)
  return jnp.where(_shifted_mask(attention_mask), lp, 0.0)


def token_logprobs(model: Any, input_ids: jax.Array, attention_mask: jax.Array, *,
                   chunk_size: int | None = None) -> jax.Array:
  """Teacher-forced per-token log-probs of `input_ids` under `model` (a `Transformer`).

  Args:
    model: provides `hidden_states(ids, attention_mask=...)` and `lm_head_kernel()`.
    input_ids: `[B, T]` int tokens (left or right padding).
    attention_mask: `[B, T]` (1 = real token, 0 = pad).
    chunk_size: token rows per vocabulary chunk (None: by the logits' size, see
      `default_chunk_rows`).

  Returns:
    `[B, T]` float32; out[:, t] = log p(input_ids[:, t] | input_ids[:, <t]) for t >= 1 where tokens
    t and t-1 are real, 0 elsewhere. Materialises at most `chunk_size * V` float32 logits at a
    time; differentiable.
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
