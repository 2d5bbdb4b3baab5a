"""Stage 1's two-model prompting: tokenizer compatibility and the proposal-side engine adapter.

Prompts are tokenised by `disa_jax.data.prompting.encode_prompt` (every stage's one encoder).

Stage 1 scores proposal samples under pi_ref, so the response token ids must mean the same thing to
both models (`check_same_vocabulary`), while each model may see the prompt in its own chat format:
the reference (and the Stage 3 policy) sees the prompt rendered with its tokenizer's template, the
proposal (an instruct model) with its own. `collect_stage1` passes one prompt token sequence to the
engine and to the scorer; `ProposalPromptEngine` keeps the reference rendering there and swaps in
the proposal's rendering on the way into the engine. It also mixes the batch's prompts into the
sampling seed: the engines derive per-sample seeds from (seed, position in the call, sample index),
and `collect_stage1` calls them batch after batch with one `SamplingParams`, so without this the
k-th prompt of every batch would get the same random stream.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import numpy as np

from disa_jax.rollout.types import Completion, SamplingParams


def check_same_vocabulary(reference_tok: Any, proposal_tok: Any) -> None:
  """Refuses tokenizers that map a shared token string to different ids.

  The proposal may have extra tokens (Qwen3's thinking tokens beside Qwen2.5's vocabulary); a
  token both tokenizers know must have one id, otherwise pi_ref would score different strings.

  Raises:
    ValueError: naming up to five disagreeing tokens.
  """
  ref, prop = reference_tok.get_vocab(), proposal_tok.get_vocab()
  bad = [(t, i, prop[t]) for t, i in ref.items() if t in prop and prop[t] != i]
  if bad:
    shown = ", ".join(f"{t!r}: reference id {i} vs proposal id {j}" for t, i, j in sorted(bad)[:5])
    raise ValueError(f"the reference and proposal tokenizers disagree on {len(bad)} token id(s) "
                     f"({shown}); Stage 1 needs a shared vocabulary")
  shared = sum(1 for t in ref if t in prop)
  if shared < 0.99 * len(ref):
    raise ValueError(f"the proposal tokenizer knows only {shared} of the reference's {len(ref)} "
                     f"tokens; Stage 1 needs a shared vocabulary")


def batch_seed(seed: int, prompts: Sequence[Sequence[int]]) -> int:
  """A 31-bit seed from ``seed`` and the token ids of a batch of prompts (order-sensitive)."""
  words = [seed % (1 << 63), len(prompts)]
  for p in prompts:
    words += [len(p)] + [int(t) for t in p]
  return int(np.random.SeedSequence(words).generate_state(1, np.uint32)[0] & 0x7FFFFFFF)


class ProposalPromptEngine:
  """An `Engine` that replaces reference-rendered prompts by the proposal's rendering.

  Args:
    engine: the proposal's engine.
    mapping: reference prompt token ids -> the proposal's token ids for the same prompt.
  """

  def __init__(self, engine: Any, mapping: Mapping[tuple[int, ...], Sequence[int]]):
    self.engine = engine
    self._mapping = {tuple(k): list(v) for k, v in mapping.items()}

  def generate(self, prompt_token_ids: Sequence[Sequence[int]],
               params: SamplingParams) -> list[list[Completion]]:
    """`Engine.generate` on the proposal renderings of the given reference prompts."""
    prompts = []
    for i, p in enumerate(prompt_token_ids):
      key = tuple(int(t) for t in p)
      if key not in self._mapping:
        raise KeyError(f"prompt {i} ({len(key)} tokens) has no proposal rendering")
      prompts.append(self._mapping[key])
    params = dataclasses.replace(params, seed=batch_seed(params.seed, prompts))
    return self.engine.generate(prompts, params)

  def update_weights(self, state_dict: Mapping[str, Any]) -> None:
    self.engine.update_weights(state_dict)

  def close(self) -> None:
    self.engine.close()
