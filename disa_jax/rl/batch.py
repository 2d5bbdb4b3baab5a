"""The typed batches of a Stage 3 step: `RolloutBatch` -> `ScoredBatch` -> `TrainBatch`.

A step reads: rollout -> score -> update. Each stage takes the previous stage's type and returns a
new one (nothing is filled in place):

1. the collector (`disa_jax.rl.collect`) samples and grades: `RolloutBatch` (prompt-major
   sequences: the G sequences of prompt p are ``p*G : (p+1)*G``);
2. the scorer (`disa_jax.rl.scorer`) takes a `RolloutBatch` and returns a `ScoredBatch`: the
   rollout with what its objective reads, the log-probs ``ref_logp`` (pi_ref) and ``old_logp``
   (pi_old) per response token, the objective's per-sequence ``signal`` (r~ for TB, the advantage
   for GRPO/GSPO) and the ``log_z`` the loss reads (the anchor's, or the batch's own estimate);
3. the update (`disa_jax.rl.update`) packs each mini-batch of a `ScoredBatch` into `TrainBatch`
   micro-batches (`ScoredBatch.micro_batches`).

A `TrainBatch` has two sides. The model side is `disa_jax.data.packing.PackedRows`: R rows of L
tokens, several sequences per row (one per row without packing; with shared prompts each prompt
once per row, followed by its responses). The loss side is per sequence
slot, ``[S, W]`` per response token (W = the max response length) and ``[S]`` per sequence,
exactly the layout the objectives read (`disa_jax.rl.objectives`); empty slots have an all-zero
response mask and contribute nothing. A field a step does not need stays None on the host and is
sent as zeros (the update never reads it: the objective declares what it reads).
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import flax.struct
import numpy as np

from disa_jax.data import packing
from disa_jax.data.packing import PackedRows


@flax.struct.dataclass
class TrainBatch:
  """One micro-batch of the update.

  Attributes:
    rows: the packed model input (``[R, L]`` fields, `PackedRows`).
    response_index: ``[S, W]`` int32, flat index into ``[R * L]`` of each response token.
    response_mask: ``[S, W]`` float32, 1 on the response tokens of each slot (the trained tokens).
    old_logp: ``[S, W]`` float32 log pi_old of each response token.
    ref_logp: ``[S, W]`` float32 log pi_ref of each response token.
    signal: ``[S]`` float32 the objective's per-sequence scalar (r~ or advantage).
    log_z: ``[S]`` float32 the anchor's log Z of the sequence's prompt (DISA), or the batch
      estimate of its group (VarGrad); zeros otherwise.
    prompt_slot: ``[S]`` int32 with shared prompts: the slot whose ``rows.token_slot`` marks the
      tokens of each slot's prompt (`disa_jax.data.packing.PackedBatch.prompt_slot`); None
      without (each slot's own).
    behaviour_logp: ``[S, W]`` float32 log mu of each response token: the distribution the engine
      sampled it from (zeros on replayed rows and empty slots); None: not recorded.
    on_policy: ``[S]`` float32, 1 on the rows the engine sampled (0 on replayed rows and empty
      slots); None with ``behaviour_logp``.
  """
  rows: PackedRows
  response_index: np.ndarray
  response_mask: np.ndarray
  old_logp: np.ndarray
  ref_logp: np.ndarray
  signal: np.ndarray
  log_z: np.ndarray
  prompt_slot: np.ndarray | None = None
  behaviour_logp: np.ndarray | None = None
  on_policy: np.ndarray | None = None

  @property
  def num_slots(self) -> int:
    return int(self.response_mask.shape[0])


@dataclasses.dataclass(frozen=True)
class RolloutBatch:
  """One RL step's graded samples on the host (the collector's output), sequences prompt-major
  ``[B = P * G]``.

  Attributes:
    prompt_ids: ``[P]`` ids of the step's prompts.
    prompt_tokens: ``[P]`` their token ids.
    group_size: G sequences per prompt.
    response_width: W, the widest response (the run's max response length).
    response_ids: ``[B]`` response token ids.
    reward: ``[B]`` float32 raw verifier rewards.
    grade_error: ``[B]`` bool, the grader raised or timed out (reward 0 there).
    is_replay: ``[B]`` bool, the sequence is a replayed Stage 1 sample (not sampled on-policy).
    sampled_logp: ``[B]`` per-token log-probs of the distribution sampled from (None: replayed).
    engine_logp: ``[B]`` raw per-token log-probs recorded by the engine (None where not asked
      for or replayed).
    finish_reason: ``[B]`` 'stop' | 'length' | 'replay'.
    stored_ref_logp: ``[B]`` float64 log pi_ref recorded by Stage 1 for replayed sequences (NaN
      for on-policy ones); checked against the recomputed value.
    generate_s: seconds spent in the engines.
    policy_version: the optimizer steps behind the weights the engine sampled with (the batch of
      step t at ``rollout.max_staleness`` k: max(t - k, 0)); replayed rows keep it too.
  """
  prompt_ids: list[str]
  prompt_tokens: list[tuple[int, ...]]
  group_size: int
  response_width: int
  response_ids: list[np.ndarray]
  reward: np.ndarray
  grade_error: np.ndarray
  is_replay: np.ndarray
  sampled_logp: list[np.ndarray | None]
  engine_logp: list[np.ndarray | None]
  finish_reason: list[str]
  stored_ref_logp: np.ndarray
  generate_s: float = 0.0
  policy_version: int = 0

  @property
  def num_rows(self) -> int:
    """B, the number of sequences."""
    return len(self.response_ids)

  @property
  def prompts(self) -> list[tuple[int, ...]]:
    """``[B]`` the prompt tokens of each sequence."""
    return [self.prompt_tokens[b // self.group_size] for b in range(self.num_rows)]

  @property
  def num_tokens(self) -> int:
    """Prompt + response tokens over all sequences."""
    return sum(len(self.prompt_tokens[b // self.group_size]) + len(r)
               for b, r in enumerate(self.response_ids))

  @property
  def grouped_reward(self) -> np.ndarray:
    """``[B]`` -> ``[P, G]`` raw rewards."""
    return self.reward.reshape(len(self.prompt_ids), self.group_size)

  def behaviour_logp(self) -> np.ndarray:
    """``[B, W]`` log mu of each response token as sampled (zeros on replayed rows)."""
    return self.response_logp_rows([np.zeros(0, np.float32) if r else lp
                                    for lp, r in zip(self.sampled_logp, self.is_replay)])

  def response_logp_rows(self, logp: Sequence[np.ndarray | None]) -> np.ndarray:
    """Per-token log-probs of each response, ``[B, W]`` (zeros beyond each response)."""
    out = np.zeros((self.num_rows, self.response_width), np.float32)
    for i, lp in enumerate(logp):
      if lp is None:
        raise ValueError(f"sequence {i} has no recorded log-probs")
      out[i, :len(lp)] = lp
    return out


@dataclasses.dataclass(frozen=True)
class ScoredBatch:
  """A `RolloutBatch` with what its objective reads (the scorer's output): what the update trains
  on (`micro_batches`).

  A field stays None exactly when the objective does not read it (`BatchScorer.score`).

  Attributes:
    rollout: the step's graded samples, ``[B = P * G]`` sequences.
    signal: ``[B]`` float32 the objective's per-sequence scalar (`Objective.batch_signal`).
    ref_logp: ``[B, W]`` float32 log pi_ref per response token (zeros beyond each response);
      None unless ``needs.reference``.
    old_logp: ``[B, W]`` float32 log pi_old per response token; None unless the objective needs
      pi_old on the host (``needs.old_logp_on_host``: not taken from the update's own forward).
    log_z: ``[B]`` float32 the log Z the loss reads: the anchor's of each row's prompt
      (``needs.anchor``) or the batch's own estimate (``needs.batch_log_z``); None for the others.
  """
  rollout: RolloutBatch
  signal: np.ndarray
  ref_logp: np.ndarray | None = None
  old_logp: np.ndarray | None = None
  log_z: np.ndarray | None = None

  def __post_init__(self):
    rows = self.rollout.num_rows
    if np.shape(self.signal) != (rows,):
      raise ValueError(f"ScoredBatch.signal has shape {np.shape(self.signal)}, expected "
                       f"({rows},): one value per row of the batch")

  def micro_batches(self, idx: np.ndarray, layout: packing.PackingLayout, *, pad_id: int
                    ) -> list[TrainBatch]:
    """Packs sequences ``idx`` (a mini-batch) into `TrainBatch` micro-batches of ``layout``.

    Every sequence lands in exactly one slot; the slots of each micro-batch carry its log-probs
    (None fields as zeros: the objective does not read them), signal, log Z, the engine's
    log-probs of the sampled tokens and the on-policy flags; empty slots carry zeros and an
    all-zero mask.
    """
    b = self.rollout
    zeros_t = np.zeros((b.num_rows, b.response_width), np.float32)  # [B, W]
    old_logp = zeros_t if self.old_logp is None else self.old_logp
    ref_logp = zeros_t if self.ref_logp is None else self.ref_logp
    signal = np.asarray(self.signal, np.float32).reshape(-1)
    log_z = (np.zeros(b.num_rows, np.float32) if self.log_z is None
             else np.asarray(self.log_z, np.float32))
    behaviour_logp, on_policy = b.behaviour_logp(), np.asarray(~b.is_replay, np.float32)
    prompts, responses = b.prompts, b.response_ids
    idx = np.asarray(idx)
    out = []
    for pb in packing.pack([prompts[i] for i in idx], [responses[i] for i in idx], layout,
                           pad_id=pad_id):
      index, mask = pb.response_index(b.response_width)
      filled = pb.seq_index >= 0
      src = idx[pb.seq_index[filled]]

      def take(a: np.ndarray) -> np.ndarray:
        full = np.zeros((len(filled),) + a.shape[1:], np.float32)
        full[filled] = a[src]
        return full

      on = mask > 0
      out.append(TrainBatch(rows=pb.rows, response_index=index, response_mask=mask,
                            old_logp=np.where(on, take(old_logp), 0.0),
                            ref_logp=np.where(on, take(ref_logp), 0.0),
                            signal=take(signal), log_z=take(log_z),
                            prompt_slot=pb.prompt_slot if layout.share_prompts else None,
                            behaviour_logp=np.where(on, take(behaviour_logp), 0.0),
                            on_policy=take(on_policy)))
    return out
