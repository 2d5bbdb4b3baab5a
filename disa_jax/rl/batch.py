"""The typed batches of a Stage 3 step: `RolloutBatch` -> `PackedRollout` -> `ScoredBatch` ->
`TrainBatch`.

A step reads: rollout -> pack -> score -> update. Each stage takes the previous stage's type and
returns a new one (nothing is filled in place), and the batch is packed once:

1. the collector (`disa_jax.rl.collect`) samples and grades: `RolloutBatch` (prompt-major
   sequences: the G sequences of prompt p are ``p*G : (p+1)*G``);
2. right after collection the updater packs it into the step's one training layout
   (`PolicyUpdater.pack`, `pack_rollout`): a `PackedRollout`, the sequences shuffled with the
   step's seed, split into mini-batches, each packed into fixed-shape micro-batches;
3. the scorer (`disa_jax.rl.scorer`) runs its passes on the layout's scoring micro-batches
   (`PackedRollout.scoring_micro`: the whole batch packed in rollout order with the same layout)
   and writes what the objective reads into the training slots: a `ScoredBatch` with the
   log-probs ``ref_slots`` (pi_ref) and
   ``old_slots`` (pi_old) per slot and response token, the objective's per-sequence ``signal``
   (r~ for TB, the advantage for GRPO/GSPO) and the ``log_z`` the loss reads (the anchor's, or the
   batch's own estimate);
4. the update (`disa_jax.rl.update`) trains on each mini-batch's `TrainBatch` micro-batches
   (`ScoredBatch.train_batches`): slices of the same layout, nothing packed again.

Per-sequence scores from elsewhere (stored or made-up: benchmarks, tests) are `SequenceScores`,
written into a layout's slots the same way (`ScoredBatch.from_rows`).

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
import functools
from typing import Sequence

import flax.struct
import numpy as np

from disa_jax.data import packing
from disa_jax.data.packing import PackedRows

# The mesh axes a micro-batch's packed rows are sharded over (per-sequence arrays are replicated).
BATCH_AXES = ("data", "fsdp")

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

  def behaviour_logp(self) -> list[np.ndarray]:
    """``[B]`` log mu of each response's tokens as sampled (empty on replayed rows)."""
    return [np.zeros(0, np.float32) if r else lp for lp, r in zip(self.sampled_logp, self.is_replay)]


@dataclasses.dataclass(frozen=True)
class PackedRollout:
  """A step's one packed training layout: the `RolloutBatch` packed right after collection, its
  mini-batches' micro-batches (`disa_jax.data.packing.PackedBatch`), which the scorer fills
  (`ScoredBatch`) and the update trains on, one mini-batch at a time.

  Every sequence is in exactly one slot of one micro-batch; per-slot arrays (``[S, W]`` per
  response token, ``[S]`` per sequence) follow the micro-batches in order (`micro`).

  Attributes:
    rollout: the step's graded samples.
    minibatches: ``[M][k_m]`` the micro-batches of each mini-batch.
    share_prompts: the layout shares prompts (`TrainBatch.prompt_slot` is set).
    layout, pad_id: the layout and padding id the micro-batches were packed with (`pack_rollout`;
      `scoring_micro` packs the scorer's own with them where it needs its own).
  """
  rollout: RolloutBatch
  minibatches: tuple[tuple[packing.PackedBatch, ...], ...]
  share_prompts: bool = False
  layout: packing.PackingLayout | None = None
  pad_id: int = 0

  @property
  def micro(self) -> list[packing.PackedBatch]:
    """Every micro-batch of the step, mini-batch by mini-batch."""
    return [pb for mb in self.minibatches for pb in mb]

  @functools.cached_property
  def scoring_micro(self) -> list[packing.PackedBatch]:
    """The micro-batches the scorer's passes run on: the whole batch packed in rollout order with
    the same layout (with shared prompts each prompt's group in one unit), packed here on the
    scorer's first pass (a step without passes packs nothing more); without a `layout`, the
    training micro-batches (`micro`).

    A sequence's log-probs depend, in their last bits, on where it sits in its row (XLA:CPU's sums
    over a row's columns; with shared prompts, the sibling responses laid out before it in its
    unit), and a mini-batch's rows hold other neighbours; the rollout-order rows are what the
    scorer read before the one packing (cf9f315), so pi_ref / pi_old keep their bits (scored on
    the training rows, every tiny-trainer run tried moved in the 7th digit)."""
    if self.layout is None:
      return self.micro
    batch = self.rollout
    return packing.pack(batch.prompts, batch.response_ids, self.layout, pad_id=self.pad_id)

  @functools.cached_property
  def scoring_index(self) -> list[tuple[np.ndarray, np.ndarray]]:
    """Where each training slot's response tokens are in the scoring passes' outputs: per
    micro-batch of `micro`, ``[S, W]`` flat indices into the ``[R, L]`` outputs of
    `scoring_micro` flattened and concatenated in order (0 where masked), and the ``[S, W]``
    float32 response mask (`disa_jax.data.packing.PackedBatch.response_index`)."""
    width = self.rollout.response_width
    at = np.zeros((self.rollout.num_rows, width), np.int64)  # [B, W]
    base = 0
    for pb in self.scoring_micro:
      index, _ = pb.response_index(width)
      filled = pb.seq_index >= 0
      at[pb.seq_index[filled]] = index[filled] + base
      base += pb.rows.input_ids.size
    out = []
    for pb in self.micro:
      _, mask = pb.response_index(width)
      out.append((np.where(mask > 0, at[np.maximum(pb.seq_index, 0)], 0), mask))
    return out

  def minibatch_slice(self, m: int) -> slice:
    """Where mini-batch ``m``'s micro-batches are in `micro`."""
    start = sum(len(mb) for mb in self.minibatches[:m])
    return slice(start, start + len(self.minibatches[m]))

  def slot_tokens(self, per_sequence: Sequence[np.ndarray | None]) -> list[np.ndarray]:
    """``[S, W]`` float32 per micro-batch: each slot's sequence's per-token values (zeros beyond
    its response and on empty slots), from ``[B]`` per-sequence arrays."""
    out = []
    width = self.rollout.response_width
    for pb in self.micro:
      slots = np.zeros((len(pb.seq_index), width), np.float32)
      for s in np.flatnonzero(pb.seq_index >= 0):
        lp = per_sequence[pb.seq_index[s]]
        if lp is None:
          raise ValueError(f"sequence {int(pb.seq_index[s])} has no recorded log-probs")
        slots[s, :len(lp)] = lp
      out.append(slots)
    return out

  def slot_values(self, values: np.ndarray) -> list[np.ndarray]:
    """``[S]`` float32 per micro-batch from ``[B]`` per-sequence values (zeros on empty slots)."""
    values = np.asarray(values, np.float32)
    out = []
    for pb in self.micro:
      filled = pb.seq_index >= 0
      slots = np.zeros((len(filled),) + values.shape[1:], np.float32)
      slots[filled] = values[pb.seq_index[filled]]
      out.append(slots)
    return out

  def sequence_values(self, slots: Sequence[np.ndarray]) -> np.ndarray:
    """The inverse of `slot_values` / `slot_tokens`: ``[B, ...]`` per-sequence values from
    per-micro-batch slot arrays (for the host's readers: a batch log Z, replay checks)."""
    out = np.zeros((self.rollout.num_rows,) + slots[0].shape[1:], slots[0].dtype)
    for pb, v in zip(self.micro, slots):
      filled = pb.seq_index >= 0
      out[pb.seq_index[filled]] = v[filled]
    return out


def pack_rollout(batch: RolloutBatch, layout: packing.PackingLayout,
                 minibatches: Sequence[np.ndarray], *, pad_id: int) -> PackedRollout:
  """The step's packed training layout: each mini-batch's sequences (``minibatches``: the
  indices of each, e.g. a shuffled split) packed into micro-batches of ``layout`` (the scorer's
  passes run on the batch packed in rollout order, `PackedRollout.scoring_micro`)."""
  prompts, responses = batch.prompts, batch.response_ids

  def packed(idx: np.ndarray) -> tuple[packing.PackedBatch, ...]:
    out = []
    for pb in packing.pack([prompts[i] for i in idx], [responses[i] for i in idx], layout,
                           pad_id=pad_id):
      seq_index = np.full_like(pb.seq_index, -1)
      filled = pb.seq_index >= 0
      seq_index[filled] = idx[pb.seq_index[filled]]  # the subset's index -> the batch's
      out.append(dataclasses.replace(pb, seq_index=seq_index))
    return tuple(out)

  return PackedRollout(batch, tuple(packed(np.asarray(idx)) for idx in minibatches),
                       share_prompts=layout.share_prompts, layout=layout, pad_id=pad_id)


@dataclasses.dataclass(frozen=True)
class ScoredBatch:
  """A `PackedRollout` with what its objective reads (the scorer's output), written into the
  slots of its micro-batches: what the update trains on (`train_batches`).

  A field stays None exactly when the objective does not read it (`BatchScorer.score`).

  Attributes:
    packed: the step's packed training layout (its rollout: ``[B = P * G]`` sequences).
    signal: ``[B]`` float32 the objective's per-sequence scalar (`Objective.batch_signal`).
    ref_slots: ``[S, W]`` float32 log pi_ref per response token of each slot, one array per
      micro-batch (`PackedRollout.micro`); None unless ``needs.reference``.
    old_slots: the same of log pi_old; None unless the objective needs pi_old on the host
      (``needs.old_logp_on_host``: not taken from the update's own forward).
    log_z: ``[B]`` float32 the log Z the loss reads: the anchor's of each row's prompt
      (``needs.anchor``) or the batch's own estimate (``needs.batch_log_z``); None for the others.
  """
  packed: PackedRollout
  signal: np.ndarray
  ref_slots: list[np.ndarray] | None = None
  old_slots: list[np.ndarray] | None = None
  log_z: np.ndarray | None = None

  def __post_init__(self):
    rows = self.rollout.num_rows
    if np.shape(self.signal) != (rows,):
      raise ValueError(f"ScoredBatch.signal has shape {np.shape(self.signal)}, expected "
                       f"({rows},): one value per row of the batch")

  @classmethod
  def from_rows(cls, packed: PackedRollout, *, signal: np.ndarray,
                ref_logp: np.ndarray | None = None, old_logp: np.ndarray | None = None,
                log_z: np.ndarray | None = None) -> "ScoredBatch":
    """From per-sequence ``[B, W]`` log-probs (stored or made-up scores: benchmarks, tests); the
    entries beyond each response are not read."""
    responses = packed.rollout.response_ids

    def slots(rows):
      return None if rows is None else packed.slot_tokens(
          [row[:len(r)] for row, r in zip(rows, responses)])

    return cls(packed, signal=signal, ref_slots=slots(ref_logp), old_slots=slots(old_logp),
               log_z=log_z)

  @property
  def rollout(self) -> RolloutBatch:
    return self.packed.rollout

  @property
  def ref_logp(self) -> np.ndarray | None:
    """``[B, W]`` log pi_ref per sequence (a copy out of the slots, for the host's readers)."""
    return None if self.ref_slots is None else self.packed.sequence_values(self.ref_slots)

  @property
  def old_logp(self) -> np.ndarray | None:
    """``[B, W]`` log pi_old per sequence (a copy out of the slots, for the host's readers)."""
    return None if self.old_slots is None else self.packed.sequence_values(self.old_slots)

  def train_batches(self, m: int) -> list[TrainBatch]:
    """Mini-batch ``m``'s `TrainBatch` micro-batches: the packed rows with their slots' log-probs
    (None fields as zeros: the objective does not read them), signal, log Z, the engine's
    log-probs of the sampled tokens and the on-policy flags; empty slots carry zeros and an
    all-zero mask."""
    packed, b = self.packed, self.rollout
    part = packed.minibatch_slice(m)
    micro = packed.micro[part]
    sub = PackedRollout(b, (tuple(micro),), packed.share_prompts)
    zeros = np.zeros(b.num_rows, np.float32)
    signal = sub.slot_values(np.asarray(self.signal, np.float32).reshape(-1))
    log_z = sub.slot_values(zeros if self.log_z is None else self.log_z)
    on_policy = sub.slot_values(~b.is_replay)
    behaviour = sub.slot_tokens(b.behaviour_logp())
    out = []
    for k, pb in enumerate(micro):
      index, mask = pb.response_index(b.response_width)

      def field(slots):
        return np.zeros_like(mask) if slots is None else slots[part][k]

      out.append(TrainBatch(rows=pb.rows, response_index=index, response_mask=mask,
                            old_logp=field(self.old_slots), ref_logp=field(self.ref_slots),
                            signal=signal[k], log_z=log_z[k],
                            prompt_slot=pb.prompt_slot if packed.share_prompts else None,
                            behaviour_logp=behaviour[k], on_policy=on_policy[k]))
    return out


@dataclasses.dataclass(frozen=True)
class SequenceScores:
  """Per-sequence scores of a `RolloutBatch` from elsewhere than the scorer (made-up or stored:
  benchmarks, tests), written into a packed layout's slots on demand.

  Attributes:
    rollout: the sequences.
    signal: ``[B]`` float32 per-sequence signal.
    ref_logp, old_logp: ``[B, W]`` float32 log-probs per response token (zeros beyond each
      response), or None.
    log_z: ``[B]`` float32 log Z, or None.
  """
  rollout: RolloutBatch
  signal: np.ndarray
  ref_logp: np.ndarray | None = None
  old_logp: np.ndarray | None = None
  log_z: np.ndarray | None = None

  def scored(self, packed: PackedRollout) -> ScoredBatch:
    """These scores in the slots of ``packed`` (a `PackedRollout` of ``rollout``)."""
    return ScoredBatch.from_rows(packed, signal=self.signal, ref_logp=self.ref_logp,
                                 old_logp=self.old_logp, log_z=self.log_z)

  def micro_batches(self, idx: np.ndarray, layout: packing.PackingLayout, *, pad_id: int
                    ) -> list[TrainBatch]:
    """Sequences ``idx`` (one mini-batch) packed into `TrainBatch` micro-batches of ``layout``."""
    packed = pack_rollout(self.rollout, layout, [np.asarray(idx)], pad_id=pad_id)
    return self.scored(packed).train_batches(0)
