"""Prompt embeddings for the anchor: mean-pooled final hidden states of a Flax LM.

Stage 2 regresses log Z on frozen prompt embeddings. Any precomputed ``[P, D]`` array works (with an
`EmbeddingSpec(source='precomputed')`); `embed_prompts` makes them from the reference model the
paper uses (the masked mean of the final hidden state over prompt tokens), in jitted batches of
packed rows (`disa_jax.data.packing`; one prompt per padded row with ``packing=False``).
"""
from __future__ import annotations

from typing import Sequence

import jax
import numpy as np
from flax import nnx

from disa_jax.anchor.frozen import EmbeddingSpec
from disa_jax.data import packing as packing_lib
from disa_jax.scoring import packed_prompt_embeddings
from disa_jax.scoring.batched import SEQS_PER_ROW, embed_packed, scoring_layout


def embed_prompts(model: nnx.Module,
                  prompt_ids: Sequence[Sequence[int]],
                  *,
                  pad_id: int,
                  batch_size: int = 64,
                  pad_to: int = 16,
                  row_len: int = 0,
                  packing: bool = True,
                  model_path: str | None = None,
                  prompt_format: str = "raw",
                  rendering: str | None = None) -> tuple[np.ndarray, EmbeddingSpec]:
  """Mean-pooled final hidden states of ``model`` over each prompt's tokens.

  Args:
    model: a `disa_jax.models.Transformer`.
    prompt_ids: P tokenised prompts.
    pad_id: padding token id.
    batch_size: rows per forward pass (the last pass is filled with empty rows).
    pad_to: without packing, the sequence-length bucket.
    row_len: with packing, tokens per row (0: the smallest power of two >= 64 holding the longest
      prompt, `disa_jax.scoring.batched.grown_row_len`).
    packing: several prompts per row (default); False: one per padded row.
    model_path, prompt_format, rendering: provenance recorded in the returned spec (model_path and
      rendering are what `Anchor.check_compatible(reference=, rendering=)` compares).

  Returns:
    (``[P, D]`` float32 embeddings, the matching `EmbeddingSpec`).
  """
  if batch_size < 1:
    raise ValueError(f"batch_size must be >= 1, got {batch_size}")
  graphdef, state = nnx.split(model)
  empty = [[] for _ in prompt_ids]
  layout = scoring_layout(packing_lib.sequence_lengths(prompt_ids, empty), packing=packing,
                          rows=batch_size, row_len=row_len, pad_to=pad_to, seqs_per_row=SEQS_PER_ROW)

  @jax.jit
  def embed(state, rows):
    return packed_prompt_embeddings(nnx.merge(graphdef, state), rows, layout.slots)

  emb = embed_packed(lambda rows: embed(state, rows), prompt_ids, layout,
                     model.config.hidden_size, pad_id=pad_id)
  return emb, EmbeddingSpec(source="model_mean_pool", dim=int(emb.shape[1]), model_path=model_path,
                            prompt_format=prompt_format, rendering=rendering)
