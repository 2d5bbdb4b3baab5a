"""Scoring many (prompt, response) pairs: packed rows of fixed shape, jitted `token_logprobs`.

Stage 1 scores proposal samples under pi_ref, the main job scores every correct answer for the
exact partition function, and evaluation scores samples under pi_ref for KL estimates: all through
`SequenceScorer`. By default it packs the sequences into rows of ``row_len`` tokens
(`disa_jax.data.packing`), ``batch_size`` rows per forward pass, so every pass has one shape. With
``packing=False`` each sequence gets its own row, padded to the pass's longest sequence rounded up
to ``pad_to`` (one compiled program per length bucket; kept for comparison).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from disa_jax.data import packing as packing_lib
from disa_jax.scoring.logprobs import packed_token_logprobs

MIN_GROWN_ROW_LEN = 64
SEQS_PER_ROW = 64  # most sequences per packed row of the scorers (and the prompt embeddings)


def grown_row_len(current: int, longest: int) -> int:
  """``row_len=0``: the smallest power of two (at least `MIN_GROWN_ROW_LEN`) holding ``longest``,
  never below ``current`` (rows only grow, so a run compiles at most log2(longest) shapes)."""
  need = max(MIN_GROWN_ROW_LEN, 1 << max(int(longest) - 1, 0).bit_length())
  return max(current, need)


def scoring_layout(lengths: np.ndarray, *, packing: bool, rows: int, row_len: int, pad_to: int,
                   seqs_per_row: int, grown: int = 0, share_prompts: bool = False
                   ) -> packing_lib.PackingLayout:
  """The layout of a scoring call on sequences of ``lengths``: fixed rows of ``row_len`` tokens
  (``row_len=0``: `grown_row_len` from ``grown``, the row length used so far), each prompt once per
  row with ``share_prompts``, or without packing one sequence per row padded to the pass's longest
  rounded up to ``pad_to``."""
  if packing:
    row_len = row_len or grown_row_len(grown, max(lengths, default=1))
  return packing_lib.micro_batch_layout(rows, packing=packing, row_len=row_len if packing else 0,
                                        seqs_per_row=seqs_per_row, pad_to=pad_to,
                                        share_prompts=share_prompts and packing)


def _pass_rows(a: np.ndarray, lo: int, per: int) -> np.ndarray:
  """Rows ``lo .. lo + per`` of ``a``, the last pass filled with copies of its first row (every
  pass one shape: one compiled program)."""
  part = a[lo:lo + per]
  return np.concatenate([part, np.repeat(part[:1], per - part.shape[0], axis=0)])


def _to_device(rows: packing_lib.PackedRows) -> packing_lib.PackedRows:
  return jax.tree.map(jnp.asarray, rows)


@dataclasses.dataclass(frozen=True)
class Packed:
  """N (prompt, response) sequences packed for a scorer (`SequenceScorer.pack`): kept by a caller
  that scores the same sequences again with new weights (the exact tracker's correct sets).

  Attributes:
    layout: the layout they were packed in.
    batches: the micro-batches.
    count: N.
    pad_id: the padding token of the rows.
  """
  layout: packing_lib.PackingLayout
  batches: tuple[packing_lib.PackedBatch, ...]
  count: int
  pad_id: int


def score_batches(fn: Callable[[packing_lib.PackedRows], jax.Array], packed: Packed, *,
                  put: Callable[[packing_lib.PackedRows], Any] = _to_device,
                  fetch: Callable[[jax.Array], np.ndarray] = np.asarray) -> list[np.ndarray]:
  """Per-token values of each of ``packed``'s N responses: N float32 arrays,
  ``[len(response_i)]`` (``fn``, ``put``, ``fetch``: as `score_packed`)."""
  out: list[Any] = [None] * packed.count
  for batch in packed.batches:
    values = fetch(fn(put(batch.rows)))  # [R, L]
    for i, v in batch.responses(values):
      out[i] = np.array(v, np.float32)
  return out


def score_packed(fn: Callable[[packing_lib.PackedRows], jax.Array],
                 prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                 layout: packing_lib.PackingLayout, *, pad_id: int,
                 put: Callable[[packing_lib.PackedRows], Any] = _to_device,
                 fetch: Callable[[jax.Array], np.ndarray] = np.asarray) -> list[np.ndarray]:
  """Per-token values of each response, computed on packed micro-batches.

  Args:
    fn: packed rows -> ``[R, L]`` per-token values (entry t belongs to token t).
    prompts, responses: N sequences.
    layout: their layout (`scoring_layout`).
    pad_id: the padding token id.
    put: host rows -> the function's input (e.g. sharded global arrays).
    fetch: the function's output -> a host array (e.g. gathered from every process).

  Returns:
    N float32 arrays, ``[len(response_i)]``.
  """
  packed = Packed(layout, tuple(packing_lib.pack(prompts, responses, layout, pad_id=pad_id)),
                  len(prompts), pad_id)
  return score_batches(fn, packed, put=put, fetch=fetch)


def make_scoring_fn(graphdef: nnx.GraphDef) -> Callable[[nnx.State, packing_lib.PackedRows], jax.Array]:
  """Jitted ``(params, packed rows [R, L]) -> [R, L]`` token log-probs (`packed_token_logprobs`).

  Stage 3 scores its rollouts with it: the reference log-probs (frozen reference params) and the
  old log-probs recomputed with the policy before the updates (`disa_jax.rl.scorer`). No gradient
  is taken.
  """

  @jax.jit
  def score(params, rows):
    return jax.lax.stop_gradient(packed_token_logprobs(nnx.merge(graphdef, params), rows))

  return score


def embed_packed(fn: Callable[[packing_lib.PackedRows], jax.Array],
                 prompts: Sequence[Sequence[int]], layout: packing_lib.PackingLayout, dim: int, *,
                 pad_id: int, put: Callable[[packing_lib.PackedRows], Any] = _to_device,
                 fetch: Callable[[jax.Array], np.ndarray] = np.asarray) -> np.ndarray:
  """Per-prompt vectors computed on packed micro-batches of the prompts alone.

  Args:
    fn: packed rows -> ``[S, dim]`` per-slot vectors (S = ``layout.slots``).
    prompts: P prompts.
    layout, pad_id, put, fetch: as `score_packed`.

  Returns:
    ``[P, dim]`` float32.
  """
  out = np.zeros((len(prompts), dim), np.float32)
  for batch in packing_lib.pack(prompts, [[] for _ in prompts], layout, pad_id=pad_id):
    values = fetch(fn(put(batch.rows)))  # [S, dim]
    filled = batch.seq_index >= 0
    # With shared prompts a unit's prompt tokens carry its first slot (`PackedBatch.prompt_slot`).
    out[batch.seq_index[filled]] = values[batch.prompt_slot[filled]]
  return out


class SequenceScorer:
  """Response log-probs under a model.

  Args:
    model: a `disa_jax.models.Transformer`.
    pad_id: padding token id.
    batch_size: rows per forward pass (with packing a row holds several sequences; the last pass
      is filled with empty rows).
    row_len: packing: tokens per row; 0 = grow to the smallest power of two (>= 64) holding the
      longest sequence seen so far (`grown_row_len`). A longer sequence than a fixed row_len is an
      error naming it.
    packing: pack several sequences per row (default); False: one per row, padded (`pad_to`).
    pad_to: without packing, the sequence-length bucket.
    seqs_per_row: with packing, most sequences per row.
    chunk_size: vocabulary-chunk rows of the scorer (None: chosen from the logits' size).
    share_prompts: with packing, the sequences of one prompt put that prompt's tokens in a row once
      (`disa_jax.data.packing`, shared prompts): the same log-probs up to float32 rounding, fewer
      tokens computed where a prompt has many responses (the exact tracker's correct sets).
  """

  def __init__(self, model: nnx.Module, *, pad_id: int, batch_size: int = 64, row_len: int = 0,
               packing: bool = True, pad_to: int = 16, seqs_per_row: int = SEQS_PER_ROW,
               chunk_size: int | None = None, share_prompts: bool = False):
    for name, v in (("batch_size", batch_size), ("pad_to", pad_to), ("seqs_per_row", seqs_per_row)):
      if v < 1:
        raise ValueError(f"SequenceScorer {name} must be >= 1, got {v}")
    if row_len < 0:
      raise ValueError(f"SequenceScorer row_len must be >= 0 (0 = grow), got {row_len}")
    self.pad_id, self.batch_size, self.pad_to = pad_id, batch_size, pad_to
    self.packing, self.row_len, self.seqs_per_row = packing, row_len, seqs_per_row
    self.share_prompts = share_prompts
    self._grown = 0  # the grown row length (row_len=0)
    self._graphdef, self._state = nnx.split(model)

    @jax.jit
    def score(state, rows):
      return packed_token_logprobs(nnx.merge(self._graphdef, state), rows, chunk_size=chunk_size)

    self._score = score

    @jax.jit
    def next_logprobs(state, ids, mask, index):
      model = nnx.merge(self._graphdef, state)
      positions = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)
      hidden = model.hidden_states(ids, attention_mask=mask, positions=positions)
      last = jnp.take_along_axis(hidden, index[:, None, None], axis=1)[:, 0]  # [B, D]
      return jax.nn.log_softmax(model.logits_from_hidden(last).astype(jnp.float32), axis=-1)

    self._next = next_logprobs

    @functools.partial(jax.jit, static_argnums=3)
    def prefill(state, ids, mask, new_tokens):
      model = nnx.merge(self._graphdef, state)
      b, w = ids.shape
      cache = model.init_cache(b, w + new_tokens)
      positions = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)
      kv_mask = jnp.concatenate([mask.astype(bool), jnp.ones((b, new_tokens), bool)], axis=1)
      logits, cache = model.forward_with_cache(ids, positions, cache, 0, kv_mask, last_only=True)
      return jax.nn.log_softmax(logits[:, 0].astype(jnp.float32), axis=-1), cache, kv_mask

    @functools.partial(jax.jit, donate_argnums=3)  # the cache updated in place: no second copy
    def decode(state, tokens, positions, cache, kv_mask, slot):
      model = nnx.merge(self._graphdef, state)
      logits, cache = model.forward_with_cache(tokens[:, None], positions[:, None], cache, slot,
                                               kv_mask)
      return jax.nn.log_softmax(logits[:, 0].astype(jnp.float32), axis=-1), cache

    self._prefill, self._decode = prefill, decode

  def update(self, model: nnx.Module) -> None:
    """Scores with new weights from now on (same architecture: no recompilation)."""
    self._state = nnx.state(model)

  def layout(self, lengths: np.ndarray) -> packing_lib.PackingLayout:
    """The layout of a call on sequences of ``lengths`` (`scoring_layout`)."""
    layout = scoring_layout(lengths, packing=self.packing, rows=self.batch_size,
                            row_len=self.row_len, pad_to=self.pad_to,
                            seqs_per_row=self.seqs_per_row, grown=self._grown,
                            share_prompts=self.share_prompts)
    self._grown = max(self._grown, layout.row_len) if self.packing else 0
    return layout

  def pack(self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], *,
           reuse: Packed | None = None) -> Packed:
    """The sequences packed in this call's layout (`layout`); ``reuse``, an earlier packing of the
    same sequences, is returned as it is when its layout is this call's (the rows the scorer
    grows to may have changed it: then they are packed anew)."""
    layout = self.layout(packing_lib.sequence_lengths(prompts, responses))
    if reuse is not None and (reuse.layout, reuse.count, reuse.pad_id) == (
        layout, len(prompts), self.pad_id):
      return reuse
    return Packed(layout, tuple(packing_lib.pack(prompts, responses, layout, pad_id=self.pad_id)),
                  len(prompts), self.pad_id)

  def token_logprobs_packed(self, packed: Packed) -> list[np.ndarray]:
    """Per-token log-probs of each packed response (`pack`): ``[len(response_i)]`` float32."""
    return score_batches(lambda rows: self._score(self._state, rows), packed)

  def token_logprobs(self, prompts: Sequence[Sequence[int]],
                     responses: Sequence[Sequence[int]]) -> list[np.ndarray]:
    """Per-token log-probs of each response: a list of ``[len(response_i)]`` float32 arrays."""
    return self.token_logprobs_packed(self.pack(prompts, responses))

  def next_token_logprobs(self, input_ids: np.ndarray, attention_mask: np.ndarray,
                          index: np.ndarray) -> np.ndarray:
    """``[B, V]`` float32 log-softmax of the next token after position ``index[b]`` of each row.

    Args:
      input_ids, attention_mask: ``[B, T]`` rows (left padding; positions count the real tokens).
      index: ``[B]`` the last real token of each row whose successor is scored.

    ``batch_size`` rows per pass (the last pass filled with copies of the first row), so a sampler
    decoding in a buffer of fixed ``T`` compiles once.
    """
    ids, mask = np.asarray(input_ids, np.int32), np.asarray(attention_mask, np.int32)
    index = np.asarray(index, np.int32)
    per = self.batch_size
    out = []
    for lo in range(0, ids.shape[0], per):
      n = ids[lo:lo + per].shape[0]
      got = self._next(self._state, *(jnp.asarray(_pass_rows(a, lo, per))
                                      for a in (ids, mask, index)))
      out.append(np.asarray(got)[:n])
    return np.concatenate(out)

  def decoder(self, input_ids: np.ndarray, attention_mask: np.ndarray, new_tokens: int
              ) -> "CachedDecoder":
    """A `CachedDecoder` of these left-padded ``[B, W]`` rows for up to ``new_tokens`` tokens."""
    return CachedDecoder(self, input_ids, attention_mask, new_tokens)

  def sequence_logprobs(self, prompts: Sequence[Sequence[int]],
                        responses: Sequence[Sequence[int]]) -> np.ndarray:
    """``[n]`` float64 trajectory log-probs sum_t log p(o_t | q, o_<t) of each response."""
    return np.asarray([float(np.sum(x, dtype=np.float64)) for x in self.token_logprobs(prompts, responses)])


class CachedDecoder:
  """Next-token log-probs of fixed rows decoded one token at a time through a KV cache: the rows'
  prompts run once (prefill), then each `step` runs one token per row, where
  `SequenceScorer.next_token_logprobs` runs the whole buffer again for every token. The same
  distributions up to float32 rounding (tests/scoring/test_batched.py).

  Rows go through in chunks of ``4 * batch_size`` (the last filled with copies of its first row),
  so every chunk has one shape: one compiled prefill and one decode program per prompt width.

  Args:
    scorer: the model's `SequenceScorer`.
    input_ids, attention_mask: ``[B, W]`` left-padded prompts (positions count the real tokens).
    new_tokens: the most tokens `step` appends to each row.
  """

  def __init__(self, scorer: SequenceScorer, input_ids: np.ndarray, attention_mask: np.ndarray,
               new_tokens: int):
    ids, mask = np.asarray(input_ids, np.int32), np.asarray(attention_mask, np.int32)
    if ids.shape != mask.shape or ids.ndim != 2 or new_tokens < 1:
      raise ValueError(f"CachedDecoder needs [B, W] ids and mask of one shape and new_tokens >= 1, "
                       f"got {ids.shape}, {mask.shape}, new_tokens={new_tokens}")
    self._scorer, self._width, self._new = scorer, ids.shape[1], int(new_tokens)
    self._rows, self._per = ids.shape[0], 4 * scorer.batch_size
    self._positions = mask.sum(axis=1).astype(np.int32)  # the next token's RoPE position
    self._t = 0
    self._chunks = []  # per chunk: (cache, kv_mask)
    first = []
    for lo in range(0, self._rows, self._per):
      logp, cache, kv_mask = scorer._prefill(scorer._state, jnp.asarray(self._fill(ids, lo)),
                                             jnp.asarray(self._fill(mask, lo)), self._new)
      self._chunks.append((cache, kv_mask))
      first.append(np.asarray(logp))
    self.logprobs = self._gather(first)  # [B, V]: the distribution of each row's next token

  def _fill(self, a: np.ndarray, lo: int) -> np.ndarray:
    return _pass_rows(a, lo, self._per)

  def _gather(self, parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts)[:self._rows].astype(np.float64)

  def step(self, tokens: np.ndarray) -> np.ndarray:
    """Appends ``[B]`` tokens (one per row; a finished row's is ignored later) and returns the
    ``[B, V]`` float64 log-softmax of the token after them (also in ``logprobs``)."""
    if self._t >= self._new:
      raise ValueError(f"CachedDecoder holds {self._new} new tokens; step {self._t + 1} is one more")
    tokens = np.asarray(tokens, np.int32).reshape(self._rows)
    s, slot, out = self._scorer, self._width + self._t, []
    for c, lo in enumerate(range(0, self._rows, self._per)):
      cache, kv_mask = self._chunks[c]
      logp, cache = s._decode(s._state, jnp.asarray(self._fill(tokens, lo)),
                              jnp.asarray(self._fill(self._positions, lo)), cache, kv_mask, slot)
      self._chunks[c] = (cache, kv_mask)
      out.append(np.asarray(logp))
    self._positions = self._positions + 1
    self._t += 1
    self.logprobs = self._gather(out)
    return self.logprobs
