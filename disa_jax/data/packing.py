"""Sequence packing: (prompt, response) sequences placed in fixed-length rows, marked by segment ids.

Every stage that runs the model over many sequences (the Stage 3 passes and update, Stage 1 and
evaluation scoring, Stage 2 prompt embeddings, SFT) feeds it `PackedRows`: R rows of L tokens.
With packing, several sequences share a row, placed first-fit-decreasing (longest first, each into
the first row with room); a segment id tells them apart (1, 2, ... within the row, 0 = padding),
positions restart at 0 in each segment, and the model attends causally within a segment only
(`disa_jax.models.Transformer`, ``segment_ids``). Without packing (``PackingLayout(packing=False)``,
kept for comparison) each sequence gets a row of its own: the same structure with one segment per
row, so there is one code path.

Shapes are fixed so that nothing recompiles whatever the mix of lengths: a micro-batch is always
R = ``layout.rows`` rows of L = ``layout.row_len`` tokens with S = R x ``layout.seqs_per_row``
sequence slots. Only the number of micro-batches varies (callers loop over them; the last one is
filled with empty rows). Padding mode with ``row_len=0`` pads each micro-batch to its longest
sequence rounded up to ``pad_to`` instead (today's padding: one shape per length bucket).

Index maps lead back to the per-sequence layout: for slot s, `PackedBatch.seq_index[s]` is the
caller's sequence (-1: an empty slot), ``seq_row / seq_offset`` where it starts, ``prompt_len /
response_len`` its parts; `PackedBatch.response_index` gives the ``[S, W]`` positions of each
response's tokens in the flattened ``[R * L]`` rows. Pure NumPy, on the host.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import flax.struct
import numpy as np


@flax.struct.dataclass
class PackedRows:
  """The model-side arrays of one micro-batch (a jit input; NumPy on the host).

  Attributes:
    input_ids: ``[R, L]`` int32 tokens (pad id on padding).
    segment_ids: ``[R, L]`` int32: 0 on padding, k on the k-th sequence of the row (1-based).
    positions: ``[R, L]`` int32 RoPE positions, restarting at 0 in each sequence (0 on padding).
    prompt_mask: ``[R, L]`` int32, 1 on prompt tokens.
    response_mask: ``[R, L]`` int32, 1 on response tokens.
    token_slot: ``[R, L]`` int32, the sequence slot in ``[0, S)`` of each token; S on padding.
  """
  input_ids: np.ndarray
  segment_ids: np.ndarray
  positions: np.ndarray
  prompt_mask: np.ndarray
  response_mask: np.ndarray
  token_slot: np.ndarray


@dataclasses.dataclass(frozen=True)
class PackingLayout:
  """How sequences are laid out in micro-batches.

  Attributes:
    packing: True: several sequences per row (first-fit-decreasing); False: one per row.
    row_len: L, tokens per row. Packing: required (>= the longest sequence). Padding: 0 = each
      micro-batch's longest sequence rounded up to ``pad_to``; > 0 = fixed.
    rows: R, rows per micro-batch.
    seqs_per_row: most sequences in one row (packing; 1 without), so S = R x seqs_per_row.
    pad_to: padding mode with ``row_len=0``: the length bucket.
  """
  packing: bool = True
  row_len: int = 0
  rows: int = 8
  seqs_per_row: int = 16
  pad_to: int = 16

  def __post_init__(self):
    for name in ("rows", "seqs_per_row", "pad_to"):
      if getattr(self, name) < 1:
        raise ValueError(f"PackingLayout.{name} must be >= 1, got {getattr(self, name)!r}")
    if self.row_len < 0 or (self.packing and self.row_len < 1):
      raise ValueError(f"PackingLayout.row_len must be >= 1 with packing (>= 0 without), got "
                       f"{self.row_len!r}")

  @property
  def slots(self) -> int:
    """S, the sequence slots of a micro-batch."""
    return self.rows * (self.seqs_per_row if self.packing else 1)


@dataclasses.dataclass(frozen=True)
class PackedBatch:
  """One micro-batch: its rows and the index maps back to the caller's sequences.

  Attributes:
    rows: the `PackedRows` (``[R, L]``).
    seq_index: ``[S]`` int64, the caller's index of the sequence in each slot; -1 = empty slot.
    seq_row: ``[S]`` int32, the row of each slot's sequence.
    seq_offset: ``[S]`` int32, the column of its first token.
    prompt_len: ``[S]`` int32, its prompt tokens (0 for an empty slot).
    response_len: ``[S]`` int32, its response tokens.
  """
  rows: PackedRows
  seq_index: np.ndarray
  seq_row: np.ndarray
  seq_offset: np.ndarray
  prompt_len: np.ndarray
  response_len: np.ndarray

  @property
  def row_len(self) -> int:
    return int(self.rows.input_ids.shape[1])

  @property
  def num_real_tokens(self) -> int:
    return int(self.prompt_len.sum() + self.response_len.sum())

  @property
  def num_computed_tokens(self) -> int:
    """R x L: the tokens the model runs over, padding included."""
    return int(self.rows.input_ids.size)

  def response_index(self, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Where each slot's response tokens are in the flattened ``[R * L]`` rows.

    Args:
      width: W, the response width of the per-sequence layout (e.g. the max response length).

    Returns:
      (``[S, W]`` int32 flat indices, 0 where masked; ``[S, W]`` float32 mask, 1 on the first
      ``response_len[s]`` entries of slot s).
    """
    too_long = np.flatnonzero(self.response_len > width)
    if too_long.size:
      s = int(too_long[0])
      raise ValueError(f"sequence {int(self.seq_index[s])} has a response of "
                       f"{int(self.response_len[s])} tokens > the response width {width}")
    j = np.arange(width)[None, :]
    mask = j < self.response_len[:, None]
    start = self.seq_row * self.row_len + self.seq_offset + self.prompt_len
    return np.where(mask, start[:, None] + j, 0).astype(np.int32), mask.astype(np.float32)

  def responses(self, token_values: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """``(caller index, [response_len] values)`` of each filled slot, from ``[R, L]`` per-token
    values (e.g. log-probs, where entry t belongs to token t)."""
    out = []
    for s in np.flatnonzero(self.seq_index >= 0):
      start = int(self.seq_offset[s] + self.prompt_len[s])
      out.append((int(self.seq_index[s]),
                  token_values[self.seq_row[s], start:start + self.response_len[s]]))
    return out


def sequence_lengths(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]]
                     ) -> np.ndarray:
  """``[N]`` prompt + response tokens of each sequence; refuses empty prompts and a count mismatch."""
  if len(prompts) != len(responses):
    raise ValueError(f"prompts and responses differ in number: {len(prompts)} vs {len(responses)}")
  for i, p in enumerate(prompts):
    if len(p) == 0:
      raise ValueError(f"sequence {i} has an empty prompt")
  return np.asarray([len(p) + len(r) for p, r in zip(prompts, responses)], np.int64)


def check_fits(lengths: np.ndarray, row_len: int) -> None:
  """Refuses a sequence longer than ``row_len``, naming its index and length."""
  over = np.flatnonzero(np.asarray(lengths) > row_len)
  if over.size:
    i = int(over[0])
    raise ValueError(f"sequence {i} has {int(lengths[i])} tokens > row_len={row_len}")


def first_fit_decreasing(lengths: np.ndarray, capacity: int, max_items: int) -> list[list[int]]:
  """Bins of at most ``capacity`` tokens and ``max_items`` sequences, first-fit-decreasing.

  Args:
    lengths: ``[N]`` sequence lengths.
    capacity: the row length L.
    max_items: most sequences per bin.

  Returns:
    The bins in the order they were opened, each the list of its sequence indices in placement
    order (longest first; ties by index, so the result is deterministic).

  Raises:
    ValueError: a sequence longer than ``capacity`` (naming its index and length).
  """
  lengths = np.asarray(lengths, np.int64)
  check_fits(lengths, capacity)
  free = np.zeros(len(lengths), np.int64)  # at most N bins
  count = np.zeros(len(lengths), np.int64)
  bins: list[list[int]] = []
  for i in np.lexsort((np.arange(len(lengths)), -lengths)):
    fits = np.flatnonzero((free[:len(bins)] >= lengths[i]) & (count[:len(bins)] < max_items))
    b = int(fits[0]) if fits.size else len(bins)
    if b == len(bins):
      bins.append([])
      free[b] = capacity
    bins[b].append(int(i))
    free[b] -= lengths[i]
    count[b] += 1
  return bins


def plan(lengths: np.ndarray, layout: PackingLayout) -> list[list[list[int]]]:
  """Micro-batches -> rows -> sequence indices: FFD rows (packing) or one sequence per row in the
  given order (padding), grouped R = ``layout.rows`` rows at a time."""
  lengths = np.asarray(lengths, np.int64)
  if layout.packing:
    rows = first_fit_decreasing(lengths, layout.row_len, layout.seqs_per_row)
  else:
    if layout.row_len:
      check_fits(lengths, layout.row_len)
    rows = [[i] for i in range(len(lengths))]
  return [rows[k:k + layout.rows] for k in range(0, len(rows), layout.rows)]


def _micro_row_len(layout: PackingLayout, lengths: np.ndarray, rows: list[list[int]]) -> int:
  if layout.row_len:
    return layout.row_len
  longest = max((int(lengths[i]) for row in rows for i in row), default=1)
  return -(-longest // layout.pad_to) * layout.pad_to


def build(rows: list[list[int]], prompts: Sequence[Sequence[int]],
          responses: Sequence[Sequence[int]], layout: PackingLayout, *, pad_id: int,
          row_len: int) -> PackedBatch:
  """The arrays of one planned micro-batch (``rows``: its rows' sequence indices)."""
  r, s = layout.rows, layout.slots
  shape = (r, row_len)
  ids = np.full(shape, pad_id, np.int32)
  seg, pos, pm, rm = (np.zeros(shape, np.int32) for _ in range(4))
  slot = np.full(shape, s, np.int32)
  meta = {k: np.zeros(s, np.int32) for k in ("seq_row", "seq_offset", "prompt_len", "response_len")}
  seq_index = np.full(s, -1, np.int64)
  k = 0
  for row, members in enumerate(rows):
    off = 0
    for j, i in enumerate(members):
      p, q = np.asarray(prompts[i], np.int32), np.asarray(responses[i], np.int32)
      n = len(p) + len(q)
      ids[row, off:off + len(p)], ids[row, off + len(p):off + n] = p, q
      seg[row, off:off + n], pos[row, off:off + n] = j + 1, np.arange(n)
      pm[row, off:off + len(p)], rm[row, off + len(p):off + n] = 1, 1
      slot[row, off:off + n] = k
      seq_index[k] = i
      for name, v in (("seq_row", row), ("seq_offset", off), ("prompt_len", len(p)),
                      ("response_len", len(q))):
        meta[name][k] = v
      off, k = off + n, k + 1
  return PackedBatch(PackedRows(ids, seg, pos, pm, rm, slot), seq_index, **meta)


def pack(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
         layout: PackingLayout, *, pad_id: int) -> list[PackedBatch]:
  """Plans and builds the micro-batches of N (prompt, response) sequences.

  Args:
    prompts: N non-empty token-id lists.
    responses: N token-id lists (may be empty).
    layout: rows, row length, slots, packing or padding.
    pad_id: the padding token id.

  Returns:
    The micro-batches; every sequence is in exactly one slot of one of them.

  Raises:
    ValueError: an empty prompt, or a sequence longer than a fixed ``row_len`` (named by index).
  """
  lengths = sequence_lengths(prompts, responses)
  return [build(mb, prompts, responses, layout, pad_id=pad_id,
                row_len=_micro_row_len(layout, lengths, mb)) for mb in plan(lengths, layout)]


def efficiency(batches: Sequence[PackedBatch]) -> float:
  """Real tokens / computed tokens (rows x row length) over ``batches``."""
  computed = sum(b.num_computed_tokens for b in batches)
  return sum(b.num_real_tokens for b in batches) / max(computed, 1)
