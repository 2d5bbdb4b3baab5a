"""Scoring many (prompt, response) pairs: padded, bucketed, jitted batches of `token_logprobs`.

Stage 1 scores proposal samples under pi_ref, the main job scores every correct answer for the
exact partition function, and evaluation scores samples under pi_ref for KL estimates: all through
`SequenceScorer`, which compiles once per (batch size, length bucket).
"""
from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from disa_jax.data.batching import pack_sequences
from disa_jax.scoring.logprobs import token_logprobs


class SequenceScorer:
  """Response log-probs under a model.

  Args:
    model: a `disa_jax.models.Transformer`.
    pad_id: padding token id.
    batch_size: sequences per forward pass (the last batch is filled with copies, then dropped).
    pad_to: sequence-length bucket.
    chunk_size: vocabulary-chunk rows of the scorer (None: chosen from the logits' size).
  """

  def __init__(self, model: nnx.Module, *, pad_id: int, batch_size: int = 64, pad_to: int = 16,
               chunk_size: int | None = None):
    if batch_size < 1 or pad_to < 1:
      raise ValueError(f"batch_size and pad_to must be >= 1, got {batch_size}, {pad_to}")
    self.pad_id, self.batch_size, self.pad_to = pad_id, batch_size, pad_to
    self._graphdef, self._state = nnx.split(model)

    @jax.jit
    def score(state, ids, attn, resp):
      lp = token_logprobs(nnx.merge(self._graphdef, state), ids, attn, chunk_size=chunk_size)
      return jnp.where(resp > 0, lp, 0.0)  # [B, T] response-token log-probs

    self._score = score

  def update(self, model: nnx.Module) -> None:
    """Scores with new weights from now on (same architecture: no recompilation)."""
    self._state = nnx.state(model)

  def token_logprobs(self, prompts: Sequence[Sequence[int]],
                     responses: Sequence[Sequence[int]]) -> list[np.ndarray]:
    """Per-token log-probs of each response: a list of ``[len(response_i)]`` float32 arrays."""
    if len(prompts) != len(responses):
      raise ValueError(f"prompts and responses differ in number: {len(prompts)} vs {len(responses)}")
    out: list[np.ndarray] = []
    for start in range(0, len(prompts), self.batch_size):
      ps, rs = list(prompts[start:start + self.batch_size]), list(responses[start:start + self.batch_size])
      n = len(ps)
      ps += [ps[-1]] * (self.batch_size - n)  # fixed batch shape
      rs += [rs[-1]] * (self.batch_size - n)
      b = pack_sequences(ps, rs, pad_id=self.pad_id, pad_to=self.pad_to)
      lp = np.asarray(self._score(self._state, jnp.asarray(b["input_ids"]), jnp.asarray(b["attention_mask"]),
                                  jnp.asarray(b["response_mask"])))
      for i in range(n):
        out.append(lp[i, len(ps[i]):len(ps[i]) + len(rs[i])].copy())
    return out

  def sequence_logprobs(self, prompts: Sequence[Sequence[int]],
                        responses: Sequence[Sequence[int]]) -> np.ndarray:
    """``[n]`` float64 trajectory log-probs sum_t log p(o_t | q, o_<t) of each response."""
    return np.asarray([float(np.sum(x, dtype=np.float64)) for x in self.token_logprobs(prompts, responses)])
