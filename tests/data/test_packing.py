"""The packing planner (`disa_jax.data.packing`): every sequence placed exactly once, no row over
its capacity, the index maps lead back to the caller's sequences, and a sequence too long for a row
is refused by index and length."""
import numpy as np
import pytest

from disa_jax.data import packing


def _random_sequences(seed, n, max_prompt, max_response):
  rng = np.random.default_rng(seed)
  prompts = [rng.integers(3, 100, rng.integers(1, max_prompt + 1)).tolist() for _ in range(n)]
  responses = [rng.integers(3, 100, rng.integers(0, max_response + 1)).tolist() for _ in range(n)]
  return prompts, responses


@pytest.mark.parametrize("seed", range(6))
def test_first_fit_decreasing_places_every_sequence_once_within_capacity(seed):
  rng = np.random.default_rng(seed)
  capacity, max_items = int(rng.integers(8, 64)), int(rng.integers(1, 6))
  lengths = rng.integers(1, capacity + 1, int(rng.integers(1, 200)))
  bins = packing.first_fit_decreasing(lengths, capacity, max_items)
  placed = sorted(i for b in bins for i in b)
  assert placed == list(range(len(lengths)))  # each index exactly once
  for b in bins:
    assert 1 <= len(b) <= max_items
    assert lengths[b].sum() <= capacity
  # First fit: no sequence could have gone into an earlier bin than the one it is in.
  free = [capacity - int(lengths[b].sum()) for b in bins]
  for k, b in enumerate(bins):
    for i in b:
      for j in range(k):
        assert free[j] < lengths[i] or len(bins[j]) == max_items


def _ffd_by_definition(lengths, capacity, max_items, counts):
  """First-fit-decreasing as written in a textbook: longest first (ties by index), each into the
  first bin, in opening order, with room for its tokens and its sequences."""
  bins, free, count = [], [], []
  for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
    b = next((b for b in range(len(bins)) if free[b] >= lengths[i]
              and count[b] + counts[i] <= max_items), len(bins))
    if b == len(bins):
      bins, free, count = bins + [[]], free + [capacity], count + [0]
    bins[b].append(i)
    free[b] -= lengths[i]
    count[b] += counts[i]
  return bins


@pytest.mark.parametrize("seed", range(4))
def test_first_fit_decreasing_places_as_the_definition_does(seed):
  """The same bins, in the same order, as the definition: the packed layouts (and every number
  trained on them) do not depend on how the planner searches."""
  rng = np.random.default_rng(100 + seed)
  for _ in range(200):
    n, capacity, max_items = int(rng.integers(1, 80)), int(rng.integers(4, 200)), int(rng.integers(1, 10))
    lengths = rng.integers(0, capacity + 1, n)  # empty responses too (shared-prompt units)
    counts = rng.integers(1, max_items + 1, n) if seed % 2 else np.ones(n, np.int64)
    got = packing.first_fit_decreasing(lengths, capacity, max_items,
                                       counts if seed % 2 else None)
    assert got == _ffd_by_definition(lengths.tolist(), capacity, max_items, counts.tolist())


def test_first_fit_decreasing_is_tight_on_an_easy_instance():
  # 4 + 4 and 6 + 2 and 8: three full bins of 8 (no padding at all).
  bins = packing.first_fit_decreasing(np.array([4, 6, 8, 2, 4]), 8, 4)
  assert sorted(sorted(b) for b in bins) == [[0, 4], [1, 3], [2]]


@pytest.mark.parametrize("lengths, index", [([5, 17, 3], 1), ([16, 16, 40, 50], 2)])
def test_too_long_sequence_is_named_by_index_and_length(lengths, index):
  with pytest.raises(ValueError, match=rf"sequence {index} has {lengths[index]} tokens > "
                                       r"row_len=16"):
    packing.first_fit_decreasing(np.array(lengths), 16, 4)
  prompts = [[1] * n for n in lengths]
  with pytest.raises(ValueError, match=rf"sequence {index} has {lengths[index]} tokens"):
    packing.pack(prompts, [[] for _ in lengths], packing.PackingLayout(row_len=16, rows=2),
                 pad_id=0)
  with pytest.raises(ValueError, match=rf"sequence {index} has {lengths[index]} tokens"):
    packing.pack(prompts, [[] for _ in lengths],
                 packing.PackingLayout(packing=False, row_len=16, rows=2), pad_id=0)


@pytest.mark.parametrize("field, value", [("rows", 0), ("seqs_per_row", 0), ("pad_to", 0),
                                          ("row_len", -1)])
def test_layout_refuses_bad_values_naming_the_field(field, value):
  kw = {"row_len": 8, field: value}
  with pytest.raises(ValueError, match=rf"PackingLayout.{field} must be .*got {value}"):
    packing.PackingLayout(**kw)
  with pytest.raises(ValueError, match=r"PackingLayout.row_len must be >= 1 with packing"):
    packing.PackingLayout(row_len=0)


def test_empty_prompt_and_count_mismatch_are_refused():
  with pytest.raises(ValueError, match="sequence 1 has an empty prompt"):
    packing.sequence_lengths([[1], [], [2]], [[], [], []])
  with pytest.raises(ValueError, match="differ in number: 2 vs 1"):
    packing.sequence_lengths([[1], [2]], [[3]])


def _check_batches(batches, prompts, responses, layout):
  """Every sequence in exactly one slot; the rows hold exactly its tokens, segment ids, positions
  and masks; fixed shapes."""
  seen = []
  for b in batches:
    r = b.rows
    assert r.input_ids.shape[0] == layout.rows and b.seq_index.shape == (layout.slots,)
    if layout.row_len:
      assert r.input_ids.shape[1] == layout.row_len
    for name in ("segment_ids", "positions", "prompt_mask", "response_mask", "token_slot"):
      assert getattr(r, name).shape == r.input_ids.shape
    for row in range(layout.rows):  # no row over its capacity / slot count
      assert int(r.segment_ids[row].max(initial=0)) <= (layout.seqs_per_row if layout.packing
                                                        else 1)
    for s in np.flatnonzero(b.seq_index >= 0):
      i, row, off = int(b.seq_index[s]), int(b.seq_row[s]), int(b.seq_offset[s])
      p, q = prompts[i], responses[i]
      n = len(p) + len(q)
      seen.append(i)
      np.testing.assert_array_equal(r.input_ids[row, off:off + n], p + q)
      np.testing.assert_array_equal(r.positions[row, off:off + n], np.arange(n))
      assert len(set(r.segment_ids[row, off:off + n].tolist())) == 1
      assert r.segment_ids[row, off] > 0 and (r.token_slot[row, off:off + n] == s).all()
      assert r.prompt_mask[row, off:off + n].sum() == len(p)
      assert r.response_mask[row, off + len(p):off + n].sum() == len(q)
    empty = b.seq_index < 0
    assert (b.prompt_len[empty] == 0).all() and (b.response_len[empty] == 0).all()
    pad = r.segment_ids == 0
    assert (r.token_slot[pad] == layout.slots).all() and (r.response_mask[pad] == 0).all()
    assert b.num_real_tokens == int((~pad).sum())
  assert sorted(seen) == list(range(len(prompts)))


@pytest.mark.parametrize("seed", range(4))
def test_pack_places_every_sequence_once_packed_and_padded(seed):
  prompts, responses = _random_sequences(seed, 37, 6, 12)
  packed = packing.PackingLayout(row_len=20, rows=3, seqs_per_row=4)
  batches = packing.pack(prompts, responses, packed, pad_id=0)
  _check_batches(batches, prompts, responses, packed)
  padded = packing.PackingLayout(packing=False, rows=4, pad_to=8)
  pad_batches = packing.pack(prompts, responses, padded, pad_id=0)
  _check_batches(pad_batches, prompts, responses, padded)
  for b in pad_batches:  # each micro-batch padded to its longest, rounded up to pad_to
    assert b.row_len % 8 == 0 and b.row_len - 8 < int((b.prompt_len + b.response_len).max())
  assert packing.efficiency(batches) > packing.efficiency(pad_batches)


def test_response_index_round_trips_per_token_values():
  prompts, responses = _random_sequences(7, 11, 4, 6)
  width = 6
  for b in packing.pack(prompts, responses, packing.PackingLayout(row_len=12, rows=2), pad_id=0):
    values = np.where(b.rows.response_mask > 0, b.rows.input_ids, -1)  # [R, L]
    index, mask = b.response_index(width)
    got = np.where(mask > 0, values.reshape(-1)[index], 0)  # [S, W]
    for s in np.flatnonzero(b.seq_index >= 0):
      q = responses[int(b.seq_index[s])]
      np.testing.assert_array_equal(got[s, :len(q)], q)
      assert mask[s].sum() == len(q)
    for i, v in b.responses(values):
      np.testing.assert_array_equal(v, responses[i])
  with pytest.raises(ValueError, match=r"sequence \d+ has a response of \d+ tokens > the "
                                       r"response width 2"):
    b.response_index(2)


def _grouped_sequences(seed, groups, max_prompt, max_response):
  """``groups`` prompts, each with 1-6 responses of 0..max_response tokens (prompt-major)."""
  rng = np.random.default_rng(seed)
  prompts, responses = [], []
  for _ in range(groups):
    p = rng.integers(3, 100, rng.integers(1, max_prompt + 1)).tolist()
    for _ in range(int(rng.integers(1, 7))):
      prompts.append(p)
      responses.append(rng.integers(3, 100, rng.integers(0, max_response + 1)).tolist())
  return prompts, responses


def _check_shared(batches, prompts, responses, layout):
  """Every sequence in exactly one slot; its unit's row holds its prompt (branch 0, positions from
  0, the unit's prompt slot) and its response (its own branch, positions continuing the prompt's);
  returns the number of prompt copies (units)."""
  seen, units = [], 0
  for b in batches:
    r = b.rows
    assert r.branch_ids.shape == r.input_ids.shape and b.seq_index.shape == (layout.slots,)
    for row in range(layout.rows):
      assert len(np.unique(r.token_slot[row][r.segment_ids[row] > 0])) <= layout.seqs_per_row
    for s in np.flatnonzero(b.seq_index >= 0):
      i, row, off = int(b.seq_index[s]), int(b.seq_row[s]), int(b.seq_offset[s])
      p, q, start = prompts[i], responses[i], int(b.response_offset[s])
      seen.append(i)
      units += int(b.prompt_slot[s] == s)
      cols = slice(off, off + len(p))
      np.testing.assert_array_equal(r.input_ids[row, cols], p)
      np.testing.assert_array_equal(r.positions[row, cols], np.arange(len(p)))
      assert (r.branch_ids[row, cols] == 0).all() and (r.prompt_mask[row, cols] == 1).all()
      assert (r.token_slot[row, cols] == b.prompt_slot[s]).all()
      cols = slice(start, start + len(q))
      np.testing.assert_array_equal(r.input_ids[row, cols], q)
      np.testing.assert_array_equal(r.positions[row, cols], len(p) + np.arange(len(q)))
      assert (r.token_slot[row, cols] == s).all() and (r.response_mask[row, cols] == 1).all()
      assert len(set(r.branch_ids[row, cols].tolist())) <= 1 and (r.branch_ids[row, cols] > 0).all()
      assert len(set(r.segment_ids[row, off:start + len(q)].tolist())) == 1
    pad = r.segment_ids == 0
    assert (r.token_slot[pad] == layout.slots).all() and (r.branch_ids[pad] == 0).all()
    assert b.num_real_tokens == int((~pad).sum())
  assert sorted(seen) == list(range(len(prompts)))
  return units


@pytest.mark.parametrize("seed", range(4))
def test_shared_prompts_place_every_sequence_once_with_one_prompt_per_unit(seed):
  prompts, responses = _grouped_sequences(seed, 9, 6, 7)
  layout = packing.PackingLayout(row_len=20, rows=3, seqs_per_row=4, share_prompts=True)
  batches = packing.pack(prompts, responses, layout, pad_id=0)
  units = _check_shared(batches, prompts, responses, layout)
  groups = len({tuple(p) for p in prompts})
  assert groups <= units < len(prompts)  # each prompt at least once, fewer copies than sequences
  unshared = packing.pack(prompts, responses, packing.PackingLayout(row_len=20, rows=3,
                                                                    seqs_per_row=4), pad_id=0)
  real = lambda bs: sum(b.num_real_tokens for b in bs)
  first = [(b, s) for b in batches for s in np.flatnonzero(b.seq_index >= 0)
           if b.prompt_slot[s] == s]
  # Computed real tokens: every response, and each unit's prompt once.
  assert real(batches) == sum(len(q) for q in responses) + sum(
      int(b.prompt_len[s]) for b, s in first)
  assert real(batches) < real(unshared) == sum(len(p) + len(q) for p, q in zip(prompts, responses))
  for b in batches:  # the per-token values of each response come back
    values = np.where(b.rows.response_mask > 0, b.rows.input_ids, -1)
    for i, v in b.responses(values):
      np.testing.assert_array_equal(v, responses[i])
    index, mask = b.response_index(7)
    for s in np.flatnonzero(b.seq_index >= 0):
      q = responses[int(b.seq_index[s])]
      np.testing.assert_array_equal(values.reshape(-1)[index[s, :len(q)]], q)


def test_a_group_too_long_for_a_row_is_split_into_units():
  # One prompt of 4 tokens with responses of 6, 5, 3, 0 and 1 tokens: 4 + 15 > 16, so two units
  # (each with its own copy of the prompt); a second prompt's unit shares a row with one of them.
  prompts = [[7, 8, 9, 10]] * 5 + [[11, 12]]
  responses = [[3] * 6, [4] * 5, [5] * 3, [], [6], [13, 14]]
  layout = packing.PackingLayout(row_len=16, rows=4, seqs_per_row=4, share_prompts=True)
  (b,) = packing.pack(prompts, responses, layout, pad_id=0)
  assert _check_shared([b], prompts, responses, layout) == 3
  assert b.rows.segment_ids.max() == 2  # two units in one row
  assert b.num_real_tokens == 2 * 4 + 15 + 2 + 2
  with pytest.raises(ValueError, match=r"sequence 1 has 17 tokens > row_len=16"):
    packing.pack([[1] * 4, [1] * 4], [[2] * 3, [2] * 13], layout, pad_id=0)


def test_first_fit_decreasing_counts_the_sequences_of_each_unit():
  bins = packing.first_fit_decreasing(np.array([5, 4, 3]), 16, 4, counts=np.array([3, 2, 1]))
  assert bins == [[0, 2], [1]]  # 3 + 2 sequences > 4: the second unit opens a new row


def test_shared_prompts_need_packing():
  with pytest.raises(ValueError, match=r"PackingLayout.share_prompts=True needs packing=True"):
    packing.PackingLayout(packing=False, share_prompts=True)
  rows = packing.pack([[1, 2]], [[3]], packing.PackingLayout(row_len=4, rows=1), pad_id=0)[0].rows
  assert rows.branch_ids is None  # without shared prompts the model input is unchanged
