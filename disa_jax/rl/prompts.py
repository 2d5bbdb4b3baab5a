"""Stage 3 training prompts: `PromptItem` and the resumable, seeded `PromptStream`."""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import numpy as np

from disa_jax.rl import seeds


@dataclasses.dataclass(frozen=True)
class PromptItem:
  """A tokenised training prompt.

  Attributes:
    prompt_id: stable id.
    token_ids: the rendered prompt's token ids (`disa_jax.data.prompting.encode_prompt`).
    meta: what the reward function needs (ground truth, tests, ...).
  """
  prompt_id: str
  token_ids: tuple[int, ...]
  meta: Mapping[str, Any] = dataclasses.field(default_factory=dict)


class PromptStream:
  """Batches of prompts in a seeded order that depends only on the batch index (resumable).

  Batch k holds the prompts at global positions [k P, (k + 1) P) of the concatenation of epoch
  orders; epoch e's order is a permutation drawn from (seed, e) (or the file order if not shuffled).
  """

  def __init__(self, items: Sequence[PromptItem], batch_size: int, *, seed: int, shuffle: bool,
               max_prompt_len: int):
    if not items:
      raise ValueError("PromptStream needs at least one prompt, got 0")
    if batch_size < 1:
      raise ValueError(f"PromptStream batch_size must be >= 1, got {batch_size}")
    ids = [it.prompt_id for it in items]
    if len(set(ids)) != len(ids):
      dup = sorted({i for i in ids if ids.count(i) > 1})[:5]
      raise ValueError(f"PromptStream: prompt ids must be unique, repeated: {dup}")
    for it in items:
      if not 0 < len(it.token_ids) <= max_prompt_len:
        raise ValueError(f"prompt {it.prompt_id!r} has {len(it.token_ids)} tokens; "
                         f"rollout.max_prompt_len={max_prompt_len}")
    self.items = list(items)
    self.batch_size = batch_size
    self.seed = seed
    self.shuffle = shuffle
    self._orders: dict[int, np.ndarray] = {}

  def _order(self, epoch: int) -> np.ndarray:
    if epoch not in self._orders:
      n = len(self.items)
      self._orders = {epoch: (seeds.epoch_rng(self.seed, epoch).permutation(n)
                              if self.shuffle else np.arange(n))}
    return self._orders[epoch]

  def batch(self, k: int) -> list[PromptItem]:
    n = len(self.items)
    return [self.items[self._order(g // n)[g % n]]
            for g in range(k * self.batch_size, (k + 1) * self.batch_size)]
