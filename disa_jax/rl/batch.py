"""The typed batches of a Stage 3 step: `RolloutBatch` on the host, `TrainBatch` into the update.

A step reads: rollout -> score -> objective -> update. `RolloutBatch` is filled in that order:

1. the collector (`disa_jax.rl.collect`) samples and grades, and packs prompt + response tokens
   into rows (prompt-major: the G rows of prompt p are ``p*G : (p+1)*G``);
2. the scorer (`disa_jax.rl.scorer`) adds the log-probs the objective needs: ``ref_logp`` (pi_ref),
   ``old_logp`` (pi_old) and ``log_z`` (the anchor's per-row value);
3. the objective adds ``signal``, its per-row scalar (r~ for TB, the advantage for GRPO / GSPO);
4. `train_batch` hands the arrays to the jitted update as a `TrainBatch` pytree.

A field a step does not need stays None on the host and is sent as zeros (the update never reads
it: the objective declares what it reads).
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import flax.struct
import numpy as np

TOKEN_FIELDS = ("input_ids", "attention_mask", "prompt_mask", "response_mask", "old_logp",
                "ref_logp")
ROW_FIELDS = ("signal", "log_z")


@flax.struct.dataclass
class TrainBatch:
  """What one update reads; every array has the same leading axes (``[B]``, or ``[K, b]`` once
  split into K micro-batches of b rows).

  Attributes:
    input_ids: ``[..., T]`` int32 prompt then response tokens, then padding.
    attention_mask: ``[..., T]`` int32, 1 on real tokens.
    prompt_mask: ``[..., T]`` float32, 1 on prompt tokens.
    response_mask: ``[..., T]`` float32, 1 on response tokens (the scored / trained tokens).
    old_logp: ``[..., T]`` float32 log pi_old of each token (entry t scores token t).
    ref_logp: ``[..., T]`` float32 log pi_ref of each token.
    signal: ``[...]`` float32 the objective's per-row scalar (r~ or advantage).
    log_z: ``[...]`` float32 the anchor's log Z of the row's prompt (DISA; zeros otherwise).
  """
  input_ids: np.ndarray
  attention_mask: np.ndarray
  prompt_mask: np.ndarray
  response_mask: np.ndarray
  old_logp: np.ndarray
  ref_logp: np.ndarray
  signal: np.ndarray
  log_z: np.ndarray

  @property
  def num_rows(self) -> int:
    return int(self.input_ids.shape[-2])

  def take(self, idx: np.ndarray) -> "TrainBatch":
    """Rows ``idx`` of a ``[B, ...]`` batch."""
    return TrainBatch(**{f: np.asarray(getattr(self, f))[idx] for f in TOKEN_FIELDS + ROW_FIELDS})

  def split(self, micro_batch_size: int) -> "TrainBatch":
    """``[M, ...]`` -> ``[M // b, b, ...]`` micro-batches of b = ``micro_batch_size`` rows."""
    m = self.input_ids.shape[0]
    if m % micro_batch_size:
      raise ValueError(f"mini-batch of {m} rows is not divisible by "
                       f"micro_batch_size={micro_batch_size}")
    return TrainBatch(**{f: np.asarray(getattr(self, f)).reshape(
        (m // micro_batch_size, micro_batch_size) + np.shape(getattr(self, f))[1:])
                         for f in TOKEN_FIELDS + ROW_FIELDS})  # [M, ...] -> [K, b, ...]


@dataclasses.dataclass
class RolloutBatch:
  """One RL step's samples on the host, rows prompt-major ``[B = P * G]``.

  Attributes:
    prompt_ids: ``[P]`` ids of the step's prompts.
    prompt_tokens: ``[P]`` their token ids.
    group_size: G rows per prompt.
    tokens: the packed ``input_ids``, ``attention_mask``, ``prompt_mask``, ``response_mask``,
      each ``[B, T]`` (`disa_jax.data.batching.pack_sequences`).
    prompt_lengths: ``[B]`` int prompt tokens of each row.
    response_ids: ``[B]`` response token ids.
    reward: ``[B]`` float32 raw verifier rewards.
    grade_error: ``[B]`` bool, the grader raised or timed out (reward 0 there).
    is_replay: ``[B]`` bool, the row is a replayed Stage 1 sample (not sampled on-policy).
    sampled_logp: ``[B]`` per-token log-probs of the distribution sampled from (None: replayed).
    engine_logp: ``[B]`` raw per-token log-probs recorded by the engine (None where not asked
      for or replayed).
    finish_reason: ``[B]`` 'stop' | 'length' | 'replay'.
    stored_ref_logp: ``[B]`` float64 log pi_ref recorded by Stage 1 for replayed rows (NaN for
      on-policy rows); checked against the recomputed value.
    ref_logp, old_logp: ``[B, T]`` float32, filled by the scorer when the objective needs them.
    log_z: ``[B]`` float32, filled by the scorer for objectives with an anchor.
    signal: ``[B]`` float32, filled by the objective (`Objective.row_signal`).
    generate_s: seconds spent in the engines.
  """
  prompt_ids: list[str]
  prompt_tokens: list[tuple[int, ...]]
  group_size: int
  tokens: dict[str, np.ndarray]
  prompt_lengths: np.ndarray
  response_ids: list[np.ndarray]
  reward: np.ndarray
  grade_error: np.ndarray
  is_replay: np.ndarray
  sampled_logp: list[np.ndarray | None]
  engine_logp: list[np.ndarray | None]
  finish_reason: list[str]
  stored_ref_logp: np.ndarray
  ref_logp: np.ndarray | None = None
  old_logp: np.ndarray | None = None
  log_z: np.ndarray | None = None
  signal: np.ndarray | None = None
  generate_s: float = 0.0

  @property
  def num_rows(self) -> int:
    return len(self.response_ids)

  @property
  def grouped_reward(self) -> np.ndarray:
    """``[B]`` -> ``[P, G]`` raw rewards."""
    return self.reward.reshape(len(self.prompt_ids), self.group_size)

  def train_batch(self) -> TrainBatch:
    """The arrays of the update (None fields as zeros: the objective does not read them)."""
    if self.signal is None:
      raise ValueError("RolloutBatch.signal is unset: the objective's row_signal has not run")
    shape = self.tokens["input_ids"].shape
    zeros_t = np.zeros(shape, np.float32)
    return TrainBatch(
        input_ids=self.tokens["input_ids"].astype(np.int32),
        attention_mask=self.tokens["attention_mask"].astype(np.int32),
        prompt_mask=self.tokens["prompt_mask"].astype(np.float32),
        response_mask=self.tokens["response_mask"].astype(np.float32),
        old_logp=zeros_t if self.old_logp is None else self.old_logp,
        ref_logp=zeros_t if self.ref_logp is None else self.ref_logp,
        signal=np.asarray(self.signal, np.float32).reshape(-1),
        log_z=(np.zeros(shape[0], np.float32) if self.log_z is None
               else np.asarray(self.log_z, np.float32)))

  def response_logp_rows(self, logp: Sequence[np.ndarray | None]) -> np.ndarray:
    """Per-token log-probs of each row's response placed at its token positions: ``[B, T]``."""
    out = np.zeros(self.tokens["input_ids"].shape, np.float32)
    for i, (start, lp) in enumerate(zip(self.prompt_lengths, logp)):
      if lp is None:
        raise ValueError(f"row {i} has no recorded log-probs")
      out[i, start:start + len(lp)] = lp
    return out
