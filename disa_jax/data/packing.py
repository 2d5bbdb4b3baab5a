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

Shared prompts (``PackingLayout(share_prompts=True)``, packing only): sequences whose prompts are
the same tokens are grouped, and a row holds each prompt once, followed by its responses (a
*unit*: one segment). ``branch_ids`` tell the responses apart (0 on the prompt, k on the unit's
k-th response); a response token attends causally to its own response and to the prompt, never to
a sibling response, and its positions continue from the prompt's (P, P + 1, ...), so every token
gets exactly the states it would get in a row of its own. A group too long for one row is split
into several units, each with its own copy of the prompt; units are placed first-fit-decreasing.
With G responses per prompt this computes the prompt once instead of G times (the RL update and
its scoring passes, where G sequences share each prompt).

Index maps lead back to the per-sequence layout: for slot s, `PackedBatch.seq_index[s]` is the
caller's sequence (-1: an empty slot), ``seq_row / seq_offset`` where its prompt starts,
``response_offset`` where its response starts, ``prompt_len / response_len`` its parts;
`PackedBatch.response_index` gives the ``[S, W]`` positions of each response's tokens in the
flattened ``[R * L]`` rows. Pure NumPy, on the host.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import flax.struct
import numpy as np

from disa_jax.parallel.mesh import rows_for_mesh


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
      A shared prompt's tokens carry the slot of its unit's first response
      (`PackedBatch.prompt_slot`).
    branch_ids: ``[R, L]`` int32 with shared prompts (0 on prompt tokens and padding, k on the
      k-th response of the token's unit, 1-based); None without (`PackingLayout.share_prompts`).
  """
  input_ids: np.ndarray
  segment_ids: np.ndarray
  positions: np.ndarray
  prompt_mask: np.ndarray
  response_mask: np.ndarray
  token_slot: np.ndarray
  branch_ids: np.ndarray | None = None


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
    share_prompts: packing only: sequences with the same prompt tokens share one copy of the prompt
      per row (see the module docstring); seqs_per_row still counts sequences (responses).
    max_segment_len: packing only: the longest segment (a sequence, or a shared-prompt unit) a row
      may hold; 0 = row_len. The model's ``max_segment_len`` (`disa_jax.models.Transformer`: the
      'xla' attention's band) is set to the same bound; `plan` refuses a longer segment on the host
      instead of letting the model turn its row into NaN.
  """
  packing: bool = True
  row_len: int = 0
  rows: int = 8
  seqs_per_row: int = 16
  pad_to: int = 16
  share_prompts: bool = False
  max_segment_len: int = 0

  def __post_init__(self):
    for name in ("rows", "seqs_per_row", "pad_to"):
      if getattr(self, name) < 1:
        raise ValueError(f"PackingLayout.{name} must be >= 1, got {getattr(self, name)!r}")
    if self.row_len < 0 or (self.packing and self.row_len < 1):
      raise ValueError(f"PackingLayout.row_len must be >= 1 with packing (>= 0 without), got "
                       f"{self.row_len!r}")
    if self.max_segment_len < 0 or (self.max_segment_len and not self.packing):
      raise ValueError(f"PackingLayout.max_segment_len must be >= 0 and 0 without packing, got "
                       f"{self.max_segment_len!r} (packing={self.packing})")
    if self.share_prompts and not self.packing:
      raise ValueError("PackingLayout.share_prompts=True needs packing=True (one sequence per row "
                       "has no prompt to share), got packing=False")

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
    seq_offset: ``[S]`` int32, the column of its prompt's first token (shared prompts: the unit's).
    prompt_len: ``[S]`` int32, its prompt tokens (0 for an empty slot).
    response_len: ``[S]`` int32, its response tokens.
    response_offset: ``[S]`` int32, the column of its response's first token (without shared
      prompts ``seq_offset + prompt_len``).
    prompt_slot: ``[S]`` int32, the slot whose ``token_slot`` its prompt's tokens carry: the slot
      itself without shared prompts, the unit's first slot with them.
  """
  rows: PackedRows
  seq_index: np.ndarray
  seq_row: np.ndarray
  seq_offset: np.ndarray
  prompt_len: np.ndarray
  response_len: np.ndarray
  response_offset: np.ndarray
  prompt_slot: np.ndarray

  @property
  def row_len(self) -> int:
    return int(self.rows.input_ids.shape[1])

  @property
  def num_real_tokens(self) -> int:
    """The non-padding tokens the model runs over: each sequence's prompt and response, a shared
    prompt counted once per unit (what is computed, not the per-sequence sum)."""
    return int(np.count_nonzero(self.rows.segment_ids))

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
    start = self.seq_row * self.row_len + self.response_offset
    return np.where(mask, start[:, None] + j, 0).astype(np.int32), mask.astype(np.float32)

  def responses(self, token_values: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """``(caller index, [response_len] values)`` of each filled slot, from ``[R, L]`` per-token
    values (e.g. log-probs, where entry t belongs to token t)."""
    out = []
    for s in np.flatnonzero(self.seq_index >= 0):
      start = int(self.response_offset[s])
      out.append((int(self.seq_index[s]),
                  token_values[self.seq_row[s], start:start + self.response_len[s]]))
    return out


def round_up(n: int, to: int) -> int:
  """``n`` rounded up to a multiple of ``to`` (a length bucket)."""
  return -(-int(n) // to) * to


def micro_batch_layout(rows: int, *, packing: bool = True, row_len: int = 0, shards: int = 1,
                       seqs_per_row: int = 16, pad_to: int = 16, share_prompts: bool = False,
                       max_segment_len: int = 0) -> PackingLayout:
  """The one layout builder of the trainers (Stage 3, LoRA-SFT, the warm-up) and the scorers.

  Args:
    rows: rows per micro-batch, rounded up to a multiple of ``shards`` (the mesh's data x fsdp
      batch shards, `disa_jax.parallel.rows_for_mesh`: every device gets whole rows).
    packing: several sequences per row (first-fit-decreasing) or one per row.
    row_len: L. Packing: required. Without: 0 = each micro-batch padded to its own longest sequence
      rounded up to ``pad_to``; > 0 = fixed.
    seqs_per_row, share_prompts, max_segment_len: packing only (`PackingLayout`).
    pad_to: the length bucket of ``row_len=0`` without packing.
  """
  rows = rows_for_mesh(rows, shards)
  if packing:
    return PackingLayout(row_len=row_len, rows=rows, seqs_per_row=seqs_per_row,
                         share_prompts=share_prompts, max_segment_len=max_segment_len)
  return PackingLayout(packing=False, row_len=row_len, rows=rows, pad_to=pad_to)


def sequence_lengths(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]]
                     ) -> np.ndarray:
  """``[N]`` prompt + response tokens of each sequence; refuses empty prompts and a count mismatch."""
  if len(prompts) != len(responses):
    raise ValueError(f"prompts and responses differ in number: {len(prompts)} vs {len(responses)}")
  for i, p in enumerate(prompts):
    if len(p) == 0:
      raise ValueError(f"sequence {i} has an empty prompt")
  return np.asarray([len(p) + len(r) for p, r in zip(prompts, responses)], np.int64)


def check_fits(lengths: np.ndarray, row_len: int, bound: str = "row_len") -> None:
  """Refuses a sequence longer than ``row_len``, naming its index and length (and ``bound``, the
  name of the limit)."""
  over = np.flatnonzero(np.asarray(lengths) > row_len)
  if over.size:
    i = int(over[0])
    raise ValueError(f"sequence {i} has {int(lengths[i])} tokens > {bound}={row_len}")


def first_fit_decreasing(lengths: np.ndarray, capacity: int, max_items: int,
                         counts: np.ndarray | None = None) -> list[list[int]]:
  """Bins of at most ``capacity`` tokens and ``max_items`` sequences, first-fit-decreasing.

  Args:
    lengths: ``[N]`` item lengths (sequences, or shared-prompt units).
    capacity: the row length L.
    max_items: most sequences per bin.
    counts: ``[N]`` sequences in each item (default 1 each: the items are sequences).

  Returns:
    The bins in the order they were opened, each the list of its item indices in placement
    order (longest first; ties by index, so the result is deterministic).

  Raises:
    ValueError: an item longer than ``capacity`` (naming its index and length).
  """
  lengths = np.asarray(lengths, np.int64)
  check_fits(lengths, capacity)
  sizes = lengths.tolist()
  many = [1] * len(sizes) if counts is None else np.asarray(counts, np.int64).tolist()
  # Plain Python over the bins still open (fewer than max_items sequences), in opening order: 4-5x
  # faster than a NumPy scan per item at the step's sizes (8-128 items), 2.7x at 4,096.
  free: list[int] = []
  count: list[int] = []
  bins: list[list[int]] = []
  open_bins: list[int] = []
  for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
    n, c = sizes[i], many[i]
    b = next((b for b in open_bins if free[b] >= n and count[b] + c <= max_items), len(bins))
    if b == len(bins):
      bins.append([])
      free.append(capacity)
      count.append(0)
      open_bins.append(b)
    bins[b].append(i)
    free[b] -= n
    count[b] += c
    if count[b] >= max_items:
      open_bins.remove(b)
  return bins


def shared_prompt_units(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                        layout: PackingLayout) -> list[list[int]]:
  """The units of shared-prompt packing: sequences grouped by identical prompt tokens, each group
  split first-fit-decreasing into as few units as hold its responses (at most ``row_len`` tokens
  with one copy of the prompt, at most ``seqs_per_row`` responses).

  Returns:
    The units (groups in order of first appearance), each the sorted indices of its sequences.

  Raises:
    ValueError: a sequence longer than ``row_len`` (naming its index and length).
  """
  check_fits(sequence_lengths(prompts, responses), layout.row_len)
  groups: dict[tuple[int, ...], list[int]] = {}
  for i, p in enumerate(prompts):
    groups.setdefault(tuple(map(int, p)), []).append(i)
  units = []
  for members in groups.values():
    room = layout.row_len - len(prompts[members[0]])
    lengths = np.asarray([len(responses[i]) for i in members], np.int64)
    if lengths.sum() <= room and len(members) <= layout.seqs_per_row:
      units.append(members)  # the whole group fits in one unit
      continue
    bins = first_fit_decreasing(lengths, room, layout.seqs_per_row)
    units += [sorted(members[j] for j in b) for b in bins]
  return units


def plan(lengths: np.ndarray, layout: PackingLayout, counts: np.ndarray | None = None
         ) -> list[list[list[int]]]:
  """Micro-batches -> rows -> item indices: FFD rows (packing) or one item per row in the given
  order (padding), grouped R = ``layout.rows`` rows at a time. The items are sequences, or with
  shared prompts units of ``counts`` sequences each."""
  lengths = np.asarray(lengths, np.int64)
  if layout.packing:
    if layout.max_segment_len:
      check_fits(lengths, layout.max_segment_len, "max_segment_len")
    rows = first_fit_decreasing(lengths, layout.row_len, layout.seqs_per_row, counts)
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


def build(rows: list[list[list[int]]], prompts: Sequence[Sequence[int]],
          responses: Sequence[Sequence[int]], layout: PackingLayout, *, pad_id: int,
          row_len: int) -> PackedBatch:
  """The arrays of one planned micro-batch.

  Args:
    rows: its rows, each a list of units, each unit the indices of sequences sharing its first
      sequence's prompt (one sequence per unit without shared prompts).
    prompts, responses: all sequences.
    layout: the layout (``share_prompts`` decides whether ``branch_ids`` are returned).
    pad_id: the padding token id.
    row_len: L.
  """
  r, s = layout.rows, layout.slots
  shape = (r, row_len)
  ids = np.full(shape, pad_id, np.int32)
  seg, pos, pm, rm, branch = (np.zeros(shape, np.int32) for _ in range(5))
  slot = np.full(shape, s, np.int32)
  meta = {k: np.zeros(s, np.int32) for k in ("seq_row", "seq_offset", "prompt_len",
                                              "response_len", "response_offset")}
  meta["prompt_slot"] = np.arange(s, dtype=np.int32)
  seq_index = np.full(s, -1, np.int64)
  k = 0
  for row, units in enumerate(rows):
    off = 0
    for j, unit in enumerate(units):
      p = np.asarray(prompts[unit[0]], np.int32)
      end = off + len(p)
      ids[row, off:end], pos[row, off:end], pm[row, off:end] = p, np.arange(len(p)), 1
      seg[row, off:end], slot[row, off:end] = j + 1, k
      for b, i in enumerate(unit):
        q = np.asarray(responses[i], np.int32)
        cols = slice(end, end + len(q))
        ids[row, cols], pos[row, cols] = q, np.arange(len(p), len(p) + len(q))
        seg[row, cols], rm[row, cols], slot[row, cols], branch[row, cols] = j + 1, 1, k + b, b + 1
        seq_index[k + b] = i
        for name, v in (("seq_row", row), ("seq_offset", off), ("prompt_len", len(p)),
                        ("response_len", len(q)), ("response_offset", end), ("prompt_slot", k)):
          meta[name][k + b] = v
        end += len(q)
      off, k = end, k + len(unit)
  rows_out = PackedRows(ids, seg, pos, pm, rm, slot, branch if layout.share_prompts else None)
  return PackedBatch(rows_out, seq_index, **meta)


def pack(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
         layout: PackingLayout, *, pad_id: int) -> list[PackedBatch]:
  """Plans and builds the micro-batches of N (prompt, response) sequences.

  Args:
    prompts: N non-empty token-id lists.
    responses: N token-id lists (may be empty).
    layout: rows, row length, slots, packing or padding, shared prompts.
    pad_id: the padding token id.

  Returns:
    The micro-batches; every sequence is in exactly one slot of one of them.

  Raises:
    ValueError: an empty prompt, or a sequence longer than a fixed ``row_len`` (named by index).
  """
  lengths = sequence_lengths(prompts, responses)
  if layout.share_prompts:
    units = shared_prompt_units(prompts, responses, layout)
    lengths = np.asarray([len(prompts[u[0]]) + sum(len(responses[i]) for i in u) for u in units],
                         np.int64)
    counts = np.asarray([len(u) for u in units], np.int64)
  else:
    units, counts = [[i] for i in range(len(prompts))], None
  return [build([[units[u] for u in row] for row in mb], prompts, responses, layout,
                pad_id=pad_id, row_len=_micro_row_len(layout, lengths, mb))
          for mb in plan(lengths, layout, counts)]


def efficiency(batches: Sequence[PackedBatch]) -> float:
  """Real tokens / computed tokens (rows x row length) over ``batches``."""
  computed = sum(b.num_computed_tokens for b in batches)
  return sum(b.num_real_tokens for b in batches) / max(computed, 1)
