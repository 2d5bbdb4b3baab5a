"""Prompt embeddings for the anchor: mean-pooled final hidden states of a Flax LM.

Stage 2 regresses log Z on frozen prompt embeddings. Any precomputed ``[P, D]`` array works (with an
`EmbeddingSpec(source='precomputed')`); `embed_prompts` makes them from the reference model the
paper uses (the masked mean of the final hidden state over prompt tokens), in padded, bucketed,
jitted batches.
"""
from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from disa_jax.anchor.frozen import EmbeddingSpec
from disa_jax.data.batching import pack_sequences
from disa_jax.scoring import prompt_embeddings


def embed_prompts(model: nnx.Module,
                  prompt_ids: Sequence[Sequence[int]],
                  *,
                  pad_id: int,
                  batch_size: int = 64,
                  pad_to: int = 16,
                  model_path: str | None = None,
                  prompt_format: str = "raw",
                  rendering: str | None = None) -> tuple[np.ndarray, EmbeddingSpec]:
  """Mean-pooled final hidden states of ``model`` over each prompt's tokens.

  Args:
    model: a `disa_jax.models.Transformer`.
    prompt_ids: P tokenised prompts.
    pad_id: padding token id.
    batch_size: prompts per forward pass (the last batch is padded with copies, then dropped).
    pad_to: sequence-length bucket.
    model_path, prompt_format, rendering: provenance recorded in the returned spec (model_path and
      rendering are what `Anchor.check_compatible(reference=, rendering=)` compares).

  Returns:
    (``[P, D]`` float32 embeddings, the matching `EmbeddingSpec`).
  """
  if batch_size < 1:
    raise ValueError(f"batch_size must be >= 1, got {batch_size}")
  graphdef, state = nnx.split(model)

  @jax.jit
  def embed(state, ids, mask):
    return prompt_embeddings(nnx.merge(graphdef, state), ids, mask)

  out = []
  for start in range(0, len(prompt_ids), batch_size):
    chunk = list(prompt_ids[start:start + batch_size])
    n = len(chunk)
    chunk += [chunk[-1]] * (batch_size - n)  # fixed batch shape: one compilation per length bucket
    b = pack_sequences(chunk, [[] for _ in chunk], pad_id=pad_id, pad_to=pad_to)
    out.append(np.asarray(embed(state, jnp.asarray(b["input_ids"]), jnp.asarray(b["prompt_mask"])))[:n])
  emb = np.concatenate(out) if out else np.zeros((0, model.config.hidden_size), np.float32)
  return emb, EmbeddingSpec(source="model_mean_pool", dim=int(emb.shape[1]), model_path=model_path,
                            prompt_format=prompt_format, rendering=rendering)
