"""Stage 1 replay in Stage 3: proposal trajectories mixed into the TB batches of DISA and FlowRL.

Proposition 3(i): with the exact log Z, the trajectory-balance loss has the tilted target as its
unique minimiser under *any* fixed full-support behaviour distribution. On-policy samples alone make
the update of an output's logit proportional to its current probability (the rich get richer); the
Stage 1 proposal samples are a fixed, broad behaviour distribution that is already sampled, graded
and scored under pi_ref. `ReplayPool` holds them by prompt id and draws, for each RL step, k of a
prompt's samples without replacement (seeded by the step, so a resumed run draws the same).

What a replayed row carries into Stage 3 (see `Trainer.rollout`):
- its response tokens and the stored raw verifier reward (the trainer applies its reward transform);
- log pi_ref recomputed by the trainer's frozen reference (the stored value is compared with it, a
  guard against a Stage 1 file scored under another reference or prompt rendering);
- log pi_theta and the old log-probs from the current policy, like any row;
- omega as on-policy rows (no importance correction: Prop. 3(i) needs none for a fixed log Z).
GRPO and GSPO never see replayed rows (`TrainConfig` refuses replay for them): their ratios assume
on-policy rollouts.
"""
from __future__ import annotations

import dataclasses
import math
import os
from typing import Mapping, Sequence

import numpy as np

from disa_jax.estimators.dataset import load_stage1
from disa_jax.rl import seeds


@dataclasses.dataclass(frozen=True)
class ReplaySample:
  """One Stage 1 proposal trajectory.

  Attributes:
    token_ids: ``[L]`` int32 response tokens.
    reward: raw verifier reward r(q, o).
    logp_ref: stored log pi_ref(o|q) (trajectory sum).
  """
  token_ids: np.ndarray
  reward: float
  logp_ref: float


class ReplayPool:
  """Stage 1 samples by prompt id.

  Args:
    samples: prompt id -> its samples (each with >= 1 token).
    skipped: reason -> number of Stage 1 samples left out when the pool was built (reported).
  """

  def __init__(self, samples: Mapping[str, Sequence[ReplaySample]],
               skipped: Mapping[str, int] | None = None):
    self.samples = {pid: list(s) for pid, s in samples.items() if len(s)}
    if not self.samples:
      raise ValueError("ReplayPool needs at least one prompt with a usable Stage 1 sample, got 0")
    self.skipped = dict(skipped or {})

  @classmethod
  def from_stage1(cls, path: str | os.PathLike, *, max_response_len: int,
                  correct_only: bool = False, dedupe: bool = False,
                  first_samples: int = 0) -> "ReplayPool":
    """Reads a Stage 1 dataset (jsonl / parquet).

    Samples that Stage 3 cannot use are left out and counted in ``skipped``: a non-finite stored
    log pi_ref (the reference gives the response zero probability, so its TB residual is infinite)
    and responses longer than ``max_response_len`` tokens (the run's rollout limit). With
    ``correct_only`` the samples with raw reward <= 0.5 are left out too, with ``dedupe`` a repeat
    of a response already in the prompt's pool (both counted). With ``first_samples`` > 0 only
    each prompt's first that many samples are read (the rest counted as ``beyond_first_samples``).
    """
    data = load_stage1(path)
    out: dict[str, list[ReplaySample]] = {}
    skipped = {"logp_ref_not_finite": 0, "longer_than_max_response_len": 0, "not_correct": 0,
               "duplicate": 0, "beyond_first_samples": 0}
    for pid, samples in zip(data.prompt_ids, data.samples):
      keep, seen = [], set()
      if first_samples:
        skipped["beyond_first_samples"] += max(0, len(samples) - first_samples)
      for s in samples[:first_samples or None]:
        why = ("logp_ref_not_finite" if not math.isfinite(s.logp_ref) else
               "longer_than_max_response_len" if len(s.token_ids) > max_response_len else
               "not_correct" if correct_only and not s.reward > 0.5 else
               "duplicate" if dedupe and s.token_ids in seen else None)
        if why:
          skipped[why] += 1
          continue
        seen.add(s.token_ids)
        keep.append(ReplaySample(np.asarray(s.token_ids, np.int32), s.reward, s.logp_ref))
      out[pid] = keep
    return cls(out, skipped)

  def __contains__(self, prompt_id: str) -> bool:
    return prompt_id in self.samples

  def coverage(self, prompt_ids: Sequence[str]) -> float:
    """Share of ``prompt_ids`` that have replay samples."""
    if not prompt_ids:
      return 0.0
    return float(np.mean([pid in self.samples for pid in prompt_ids]))

  def draw(self, prompt_ids: Sequence[str], k: int, seed: int) -> list[list[ReplaySample]]:
    """``[P][k]`` samples (``[]`` for a prompt without samples), seeded by ``seed`` and position.

    A prompt with at least k samples gets k distinct ones; one with fewer gets all of them and the
    rest drawn again (with replacement), so every covered prompt contributes exactly k rows.
    """
    if k < 0:
      raise ValueError(f"ReplayPool.draw k must be >= 0, got {k}")
    out = []
    for i, pid in enumerate(prompt_ids):
      pool = self.samples.get(pid)
      if not pool or k == 0:
        out.append([])
        continue
      rng = seeds.replay_prompt_rng(seed, i)
      if len(pool) >= k:
        idx = rng.choice(len(pool), k, replace=False)
      else:
        idx = np.concatenate([rng.permutation(len(pool)),
                              rng.integers(0, len(pool), k - len(pool))])
      out.append([pool[j] for j in idx])
    return out


def replay_count(fraction: float, group_size: int) -> int:
  """Replayed samples per group of ``group_size``: round(fraction * G)."""
  return int(round(fraction * group_size))
