"""Teacher-forced per-token log-probabilities, chunked over tokens when `[B, T, V]` would be large.

The final hidden states `[B, T, D]` are flattened to `[B*T, D]` rows, and each row's logits are
reduced to `logit[target] - logsumexp(logits)` in float32 (`head.target_logprobs`, whose backward
is written out). When all rows' logits are small (at most `UNCHUNKED_MAX_ELEMENTS`, e.g. a small
vocabulary) they are computed in one piece. Otherwise the rows go in chunks of `chunk_size` rows,
and at most `[chunk_size, V]` logits are live in the forward pass. Under differentiation the
logits of all rows are kept for the backward pass while they take at most
`head.SAVED_LOGITS_MAX_ELEMENTS`, and recomputed chunk by chunk beyond (peak memory O(chunk_size *
V) in both directions). Everything is differentiable w.r.t. the model.

Packed rows (`disa_jax.data.packing`): with ``segment_ids`` the model attends within a segment and
a segment's first token is not scored; with shared prompts (``branch_ids``) the first token of each
response is scored from the prompt's last hidden state (`branch_predictors`), not from the previous
response's last one; `gather_responses` takes the ``[R, L]`` per-token values back
to the per-sequence ``[S, W]`` response layout, and `segment_mean` pools hidden states per
sequence (prompt embeddings, the FlowRL head's input).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from disa_jax.scoring.head import SAVED_LOGITS_MAX_ELEMENTS, target_logprobs

DEFAULT_CHUNK_SIZE = 1024  # rows per chunk when the logits are chunked
# chunk_size=None: no chunking while rows * V <= this (2**25 float32 logits = 128 MiB).
UNCHUNKED_MAX_ELEMENTS = 1 << 25


def _shifted_mask(attention_mask: jax.Array | None, segment_ids: jax.Array | None = None
                  ) -> jax.Array:
  """`[B, T]` bool: position t is scored iff t >= 1 and tokens t and t-1 are both real and, with
  ``segment_ids``, in the same segment (the first token of a packed sequence is not scored
  against the previous sequence's last token). A shared-prompt unit is one segment, so the first
  token of each of its responses is scored (from the prompt's last state, `branch_predictors`)."""
  if segment_ids is not None:
    seg = segment_ids.astype(jnp.int32)
    same = (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] > 0)
    return jnp.concatenate([jnp.zeros_like(same[:, :1]), same], axis=1)
  m = attention_mask.astype(bool)
  return jnp.concatenate([jnp.zeros_like(m[:, :1]), m[:, 1:] & m[:, :-1]], axis=1)


def branch_predictors(segment_ids: jax.Array, branch_ids: jax.Array) -> jax.Array:
  """Shared-prompt rows: the column of the hidden state that predicts each token.

  Args:
    segment_ids: `[B, T]` int, 0 = padding, k = the row's k-th unit (a prompt and its responses).
    branch_ids: `[B, T]` int, 0 on prompt tokens, k on the unit's k-th response.

  Returns:
    `[B, T]` int32: t - 1, except at a response's first token (its branch differs from the
    previous token's), where it is the column of the unit's last prompt token (0 at t = 0).
  """
  seg, br = segment_ids.astype(jnp.int32), branch_ids.astype(jnp.int32)
  col = jax.lax.broadcasted_iota(jnp.int32, seg.shape, 1)
  # A unit's prompt precedes its responses: the latest prompt column is the unit's last one.
  last_prompt = jax.lax.cummax(jnp.where((br == 0) & (seg > 0), col, -1), axis=1)
  prev = jnp.concatenate([jnp.zeros_like(br[:, :1]), br[:, :-1]], axis=1)
  starts = (br > 0) & (br != prev)
  return jnp.maximum(jnp.where(starts, last_prompt, col - 1), 0)


def default_chunk_rows(rows: int, vocab_size: int) -> int:
  """Rows per chunk for `chunk_size=None`: all `rows` (one chunk, no recomputation) when
  `rows * vocab_size <= UNCHUNKED_MAX_ELEMENTS`, else `DEFAULT_CHUNK_SIZE`."""
  return rows if rows * vocab_size <= UNCHUNKED_MAX_ELEMENTS else DEFAULT_CHUNK_SIZE


def logprobs_from_hidden(hidden: jax.Array, kernel: jax.Array, input_ids: jax.Array,
                         attention_mask: jax.Array | None, *, chunk_size: int | None = None,
                         segment_ids: jax.Array | None = None,
                         branch_ids: jax.Array | None = None) -> jax.Array:
  """Per-token log-probs from final hidden states and the output projection.

  Args:
    hidden: `[B, T, D]` final-normed hidden states (any float dtype).
    kernel: `[D, V]` output projection.
    input_ids: `[B, T]` int tokens; `input_ids[:, t]` is scored from `hidden[:, t - 1]`.
    attention_mask: `[B, T]` (1 = real token, 0 = pad); None with ``segment_ids``.
    chunk_size: rows of `[B*(T-1), D]` per chunk (peak extra memory ~ chunk_size * V float32);
      None: `default_chunk_rows(B*(T-1), V)`. When all rows fit in one chunk there is no chunking
      and no recomputation in the backward pass.
    segment_ids: `[B, T]` packed-row segments (0 = padding), instead of ``attention_mask``.
    branch_ids: `[B, T]` shared-prompt branches (with ``segment_ids``): token t is scored from
      `hidden[:, branch_predictors(...)[:, t]]` (a response's first token from its prompt's last
      state) instead of `hidden[:, t - 1]`.

  Returns:
    `[B, T]` float32: log p(input_ids[:, t] | input_ids[:, <t]) where scored (see
    `_shifted_mask`), 0 elsewhere, including t = 0 and each segment's first token.
  """
  if branch_ids is not None and segment_ids is None:
    raise ValueError("branch_ids (shared prompts) need segment_ids, got None")
  if chunk_size is not None and chunk_size < 1:
    raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
  if (attention_mask is None) == (segment_ids is None):
    raise ValueError("pass exactly one of attention_mask and segment_ids")
  b, t, d = hidden.shape
  mask = attention_mask if segment_ids is None else segment_ids
  if input_ids.shape != (b, t) or mask.shape != (b, t):
    raise ValueError(f"input_ids {input_ids.shape} and the mask / segment ids {mask.shape} must "
                     f"both be [B, T] = {(b, t)}")
  if t < 2:
    return jnp.zeros((b, t), jnp.float32)
  with jax.named_scope("logprobs"):  # names the ops in profiles
    if branch_ids is None:
      pred = hidden[:, :-1]  # [B, T-1, D]: column i predicts token i + 1
    else:
      src = branch_predictors(segment_ids, branch_ids)[:, 1:, None]  # [B, T-1, 1]
      pred = jnp.take_along_axis(hidden, src, axis=1)  # [B, T-1, D]
    lp = _chunked_logprobs(pred, kernel, input_ids, chunk_size)
    return jnp.where(_shifted_mask(attention_mask, segment_ids), lp, 0.0)


def _chunked_logprobs(pred: jax.Array, kernel: jax.Array, input_ids: jax.Array,
                      chunk_size: int | None) -> jax.Array:
  """`logprobs_from_hidden` after its checks (T >= 2), before masking: `[B, T]` from the
  predicting states ``pred`` `[B, T-1, D]` (column i predicts token i + 1)."""
  b, t1, d = pred.shape
  t = t1 + 1
  n = b * (t - 1)
  rows = pred.reshape(n, d)  # [B, T-1, D] -> [N, D]; row b*(T-1)+i predicts token i+1
  targets = input_ids[:, 1:].reshape(n)  # [B, T-1] -> [N]
  vocab = kernel.shape[1]
  targets = jnp.clip(targets, 0, vocab - 1)  # ids outside the vocabulary sit on masked positions
  chunk = min(chunk_size or default_chunk_rows(n, vocab), n)
  n_chunks = -(-n // chunk)
  pad = n_chunks * chunk - n
  rows = jnp.pad(rows, ((0, pad), (0, 0))).reshape(n_chunks, chunk, d)  # [N, D] -> [C, c, D]
  targets = jnp.pad(targets, (0, pad)).reshape(n_chunks, chunk)  # [N] -> [C, c]
  save = n_chunks * chunk * vocab <= SAVED_LOGITS_MAX_ELEMENTS
  lp = target_logprobs(rows, targets, kernel.astype(pred.dtype), save)
  lp = lp.reshape(n_chunks * chunk)[:n]  # [C, c] -> [N]
  return jnp.concatenate([jnp.zeros((b, 1), jnp.float32), lp.reshape(b, t - 1)], axis=1)


def token_logprobs(model: Any, input_ids: jax.Array, attention_mask: jax.Array | None = None, *,
                   chunk_size: int | None = None, segment_ids: jax.Array | None = None,
                   positions: jax.Array | None = None,
                   branch_ids: jax.Array | None = None) -> jax.Array:
  """Teacher-forced per-token log-probs of `input_ids` under `model` (a `Transformer`).

  Args:
    model: provides `hidden_states(ids, attention_mask=..., segment_ids=..., positions=...)` and
      `lm_head_kernel()`.
    input_ids: `[B, T]` int tokens (left or right padding, or packed rows).
    attention_mask: `[B, T]` (1 = real token, 0 = pad); None with ``segment_ids``.
    chunk_size: token rows per vocabulary chunk (None: by the logits' size, see
      `default_chunk_rows`).
    segment_ids: `[B, T]` packed rows (`disa_jax.data.packing.PackedRows`): 0 = padding, k = the
      row's k-th sequence; attention and scoring stay within a segment.
    positions: `[B, T]` RoPE positions (default: the model's, restarting in each segment).
    branch_ids: `[B, T]` shared-prompt branches (`PackedRows.branch_ids`; needs ``positions``).

  Returns:
    `[B, T]` float32; out[:, t] = log p(input_ids[:, t] | input_ids[:, <t]) for t >= 1 where tokens
    t and t-1 are real (and in one segment), 0 elsewhere. Materialises at most `chunk_size * V`
    float32 logits at a time; differentiable.
  """
  hidden = model.hidden_states(input_ids, attention_mask=attention_mask, segment_ids=segment_ids,
                               positions=positions, branch_ids=branch_ids)
  return logprobs_from_hidden(hidden, model.lm_head_kernel(), input_ids, attention_mask,
                              chunk_size=chunk_size, segment_ids=segment_ids,
                              branch_ids=branch_ids)


def packed_token_logprobs(model: Any, rows: Any, *, chunk_size: int | None = None) -> jax.Array:
  """`token_logprobs` of packed rows (`disa_jax.data.packing.PackedRows`, ``[R, L]`` fields),
  shared prompts included.

  Returns:
    `[R, L]` float32 (entry t scores token t; 0 on padding and each segment's first token).
  """
  return token_logprobs(model, rows.input_ids, chunk_size=chunk_size, segment_ids=rows.segment_ids,
                        positions=rows.positions, branch_ids=rows.branch_ids)


def gather_responses(token_lp: jax.Array, response_index: jax.Array, response_mask: jax.Array
                     ) -> jax.Array:
  """Per-token values of packed rows -> the per-sequence response layout.

  Args:
    token_lp: `[R, L]` per-token values of the packed rows.
    response_index: `[S, W]` int flat indices into `[R * L]` of each sequence's response tokens
      (`PackedBatch.response_index`).
    response_mask: `[S, W]` 1 on real response tokens.

  Returns:
    `[S, W]` float32: entry (s, j) = the value of response token j of sequence s; 0 where masked.
  """
  flat = token_lp.reshape(-1)  # [R, L] -> [R * L]
  return jnp.where(response_mask > 0, jnp.take(flat, response_index, axis=0), 0.0)


def segment_mean(values: jax.Array, weights: jax.Array, token_slot: jax.Array, num_slots: int
                 ) -> jax.Array:
  """Weighted mean of each sequence slot's token values (a segment sum over packed rows).

  Args:
    values: `[R, L, D]` per-token vectors.
    weights: `[R, L]` per-token 0 / 1 weights (0 = left out).
    token_slot: `[R, L]` int slot of each token in `[0, S)`; S (or more) = no slot.
    num_slots: S.

  Returns:
    `[S, D]` float32 (zeros for a slot with no weight).
  """
  d = values.shape[-1]
  w = weights.astype(jnp.float32).reshape(-1)  # [R, L] -> [R * L]
  ids = jnp.minimum(token_slot.reshape(-1), num_slots)  # out-of-range -> the dropped slot S
  x = values.astype(jnp.float32).reshape(-1, d) * w[:, None]  # [R * L, D]
  total = jax.ops.segment_sum(x, ids, num_segments=num_slots + 1)[:num_slots]
  count = jax.ops.segment_sum(w, ids, num_segments=num_slots + 1)[:num_slots]
  return total / jnp.maximum(count, 1.0)[:, None]


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


def packed_prompt_embeddings(model: Any, rows: Any, num_slots: int) -> jax.Array:
  """Mean of the final-normed hidden state over each sequence's prompt tokens (the Stage 2 anchor
  input), on packed rows.

  Args:
    model: provides `hidden_states`.
    rows: `disa_jax.data.packing.PackedRows` (``[R, L]``): prompts, possibly with responses.
    num_slots: S, the sequence slots of the micro-batch.

  Returns:
    `[S, D]` float32 (zeros for an empty slot; with shared prompts a unit's prompt embedding is at
    its first slot, `PackedBatch.prompt_slot`, the other slots of the unit get zeros).
  """
  hidden = model.hidden_states(rows.input_ids, segment_ids=rows.segment_ids,
                               positions=rows.positions, branch_ids=rows.branch_ids)
  return segment_mean(hidden, rows.prompt_mask, rows.token_slot, num_slots)


def prompt_embeddings(model: Any, input_ids: jax.Array, prompt_mask: jax.Array) -> jax.Array:
  """`packed_prompt_embeddings` of a padded batch: one prompt per row.

  Args:
    model: provides `hidden_states`.
    input_ids: `[B, T]` tokens (prompt, possibly followed by more tokens; causal attention makes
      prompt states independent of what follows).
    prompt_mask: `[B, T]` (1 = prompt token), one contiguous prompt per row.

  Returns:
    `[B, D]` float32 (zeros for a row without prompt tokens).
  """
  b = input_ids.shape[0]
  pm = (prompt_mask > 0).astype(jnp.int32)
  slot = jnp.where(pm > 0, jnp.arange(b, dtype=jnp.int32)[:, None], b)
  hidden = model.hidden_states(input_ids, segment_ids=pm)
  return segment_mean(hidden, pm, slot, b)
