"""Every seed of a Stage 3 run, derived from the run's ``seed`` in one place.

A resumed run must sample, shuffle and draw exactly what an uninterrupted one would, so every
random choice of step k is a pure function of (run seed, what it is for, k). Each derivation below
names its use; callers never build a seed themselves:

- `derive_seed`: the hash every named 31-bit seed comes from;
- `rollout_seed` / `validation_seed` / `replay_seed`: the engine's sampling seed of step k's
  rollouts, of the validation after ``done`` steps, and of step k's Stage 1 replay draw;
- `objective_seed`: the seed an objective's own state is initialised with (`Objective.init_state`);
- `epoch_rng` / `minibatch_rng` / `replay_prompt_rng`: the generators of the prompt order of an
  epoch, of the mini-batch split of step k, and of one prompt's replay draw.
"""
from __future__ import annotations

import hashlib
from typing import Any

import numpy as np


def derive_seed(*parts: Any) -> int:
  """A 31-bit seed from any hashable description (e.g. ``(seed, 'rollout', step)``)."""
  digest = hashlib.sha256(repr(parts).encode()).digest()
  return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def rollout_seed(seed: int, step: int) -> int:
  """The engine's sampling seed of RL step ``step``'s rollouts (the extra on-policy call for the
  prompts without Stage 1 samples uses this + 1)."""
  return derive_seed(seed, "rollout", step)


def validation_seed(seed: int, done: int) -> int:
  """The engine's sampling seed of the validation after ``done`` steps."""
  return derive_seed(seed, "validation", done)


def replay_seed(seed: int, step: int) -> int:
  """The seed of RL step ``step``'s Stage 1 replay draw (`ReplayPool.draw`)."""
  return derive_seed(seed, "replay", step)


def objective_seed(seed: int, name: str) -> int:
  """The seed ``name`` of an objective's trainable state (`Objective.init_state`'s ``seed``)."""
  return derive_seed(seed, name)


def epoch_rng(seed: int, epoch: int) -> np.random.Generator:
  """The generator of the training prompts' order in ``epoch`` (`PromptStream`)."""
  return np.random.default_rng([seed, epoch])


def minibatch_rng(seed: int, step: int) -> np.random.Generator:
  """The generator of RL step ``step``'s shuffle into mini-batches (`PolicyUpdater.update`)."""
  return np.random.default_rng([seed, step, 17])


def replay_prompt_rng(draw_seed: int, position: int) -> np.random.Generator:
  """The generator of one prompt's replay samples: the draw's seed (`replay_seed`) and the prompt's
  position in the step's batch."""
  return np.random.default_rng([draw_seed, position])
