"""Packing prompts and responses into padded token batches with the masks every stage uses.

Layout (right padding; positions follow `attention_mask`, so left-padded batches work as well):

    input_ids      [B, T] int32   prompt tokens, then response tokens, then pad
    attention_mask [B, T] int32   1 on real tokens
    prompt_mask    [B, T] int32   1 on prompt tokens
    response_mask  [B, T] int32   1 on response tokens (these are the tokens scored / trained on)

T is rounded up to a multiple of ``pad_to`` so that jitted functions see few distinct shapes.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np


def pack_sequences(prompts: Sequence[Sequence[int]],
                   responses: Sequence[Sequence[int]],
                   *,
                   pad_id: int,
                   pad_to: int = 8,
                   min_len: int = 0) -> dict[str, np.ndarray]:
  """Concatenates each prompt with its response and pads to a common length.

  Args:
    prompts: B token-id lists (non-empty).
    responses: B token-id lists (may be empty).
    pad_id: the padding token id.
    pad_to: T is a multiple of this (bucketing against recompilation).
    min_len: lower bound on T.

  Returns:
    dict with ``input_ids``, ``attention_mask``, ``prompt_mask``, ``response_mask``, all ``[B, T]`` int32.
  """
  if len(prompts) != len(responses):
    raise ValueError(f"prompts and responses differ in number: {len(prompts)} vs {len(responses)}")
  if pad_to < 1:
    raise ValueError(f"pad_to must be >= 1, got {pad_to}")
  for i, p in enumerate(prompts):
    if len(p) == 0:
      raise ValueError(f"prompt {i} is empty")
  b = len(prompts)
  longest = max((len(p) + len(r) for p, r in zip(prompts, responses)), default=1)
  t = max(min_len, -(-longest // pad_to) * pad_to)
  out = {k: np.zeros((b, t), np.int32) for k in ("input_ids", "attention_mask", "prompt_mask", "response_mask")}
  out["input_ids"][:] = pad_id
  for i, (p, r) in enumerate(zip(prompts, responses)):
    lp, lr = len(p), len(r)
    out["input_ids"][i, :lp] = p
    out["input_ids"][i, lp:lp + lr] = r
    out["attention_mask"][i, :lp + lr] = 1
    out["prompt_mask"][i, :lp] = 1
    out["response_mask"][i, lp:lp + lr] = 1
  return out
