"""Packed rows (segment ids) vs padded rows vs every sequence alone: per-token log-probs and prompt
embeddings agree within 1e-5 in float32, and a token never sees across a segment boundary."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from disa_jax import scoring, testing
from disa_jax.data import packing
from disa_jax.scoring.batched import SequenceScorer

TOL = 1e-5
# A one-token response, an empty one, a sequence of exactly the row length (16), the rest sharing
# rows with boundaries mid-row.
LENGTHS = [(3, 1), (2, 5), (6, 10), (4, 4), (1, 7), (5, 0), (3, 9), (2, 2)]


@pytest.fixture(scope="module")
def model():
  return testing.make_tiny_model("qwen3", seed=3)


def _sequences(seed=0, lengths=LENGTHS):
  rng = np.random.default_rng(seed)
  return ([rng.integers(3, 120, p).tolist() for p, _ in lengths],
          [rng.integers(3, 120, r).tolist() for _, r in lengths])


def _alone(model, prompts, responses):
  """Each response's token log-probs, its sequence run alone ([1, n], no padding)."""
  out = []
  for p, r in zip(prompts, responses):
    ids = jnp.asarray([p + r])
    out.append(np.asarray(scoring.token_logprobs(model, ids, jnp.ones_like(ids)))[0, len(p):])
  return out


def _by_layout(model, prompts, responses, layout):
  """Each response's token log-probs from `packed_token_logprobs` on ``layout``'s rows."""
  out = [None] * len(prompts)
  score = jax.jit(lambda rows: scoring.packed_token_logprobs(model, rows))
  for b in packing.pack(prompts, responses, layout, pad_id=0):
    for i, v in b.responses(np.asarray(score(jax.tree.map(jnp.asarray, b.rows)))):
      out[i] = v
  return out


@pytest.mark.slow
def test_packed_logprobs_equal_padded_and_alone(model):
  prompts, responses = _sequences()
  packed_layout = packing.PackingLayout(row_len=16, rows=2, seqs_per_row=4)
  batches = packing.pack(prompts, responses, packed_layout, pad_id=0)
  rows = [r for b in batches for r in b.rows.segment_ids]
  assert any(r.max() >= 2 and r[-1] > 0 for r in rows)  # a full row of several sequences
  assert any((r == 1).all() for r in rows)  # one sequence of exactly the row length
  packed = _by_layout(model, prompts, responses, packed_layout)
  padded = _by_layout(model, prompts, responses, packing.PackingLayout(packing=False, rows=3,
                                                                       pad_to=8))
  alone = _alone(model, prompts, responses)
  # Today's padded path: attention_mask on right-padded rows, no segment ids.
  (b,) = packing.pack(prompts, responses, packing.PackingLayout(packing=False, rows=8, pad_to=8),
                      pad_id=0)
  lp = np.asarray(scoring.token_logprobs(model, jnp.asarray(b.rows.input_ids),
                                         jnp.asarray((b.rows.segment_ids > 0).astype(np.int32))))
  legacy = dict(b.responses(lp))
  for i in range(len(prompts)):
    assert packed[i].shape == (len(responses[i]),)
    np.testing.assert_allclose(packed[i], alone[i], rtol=TOL, atol=TOL)
    np.testing.assert_allclose(padded[i], alone[i], rtol=TOL, atol=TOL)
    np.testing.assert_allclose(legacy[i], packed[i], rtol=TOL, atol=TOL)


def test_a_token_never_attends_across_a_segment_boundary(model):
  """Changing one packed sequence (its tokens, then its length) leaves the log-probs of the other
  sequences of its row unchanged; its own change."""
  prompts, responses = _sequences(1, [(3, 4), (2, 5), (4, 2)])
  layout = packing.PackingLayout(row_len=24, rows=1, seqs_per_row=4)
  assert packing.pack(prompts, responses, layout, pad_id=0)[0].rows.segment_ids.max() == 3
  base = _by_layout(model, prompts, responses, layout)
  rng = np.random.default_rng(9)
  for new_prompt, new_response in [(prompts[1], rng.integers(3, 120, 5).tolist()),
                                   (rng.integers(3, 120, 6).tolist(), [7, 8])]:
    changed = _by_layout(model, prompts[:1] + [new_prompt] + prompts[2:],
                         responses[:1] + [new_response] + responses[2:], layout)
    for i in (0, 2):
      np.testing.assert_allclose(changed[i], base[i], rtol=1e-6, atol=1e-6)
    assert changed[1].shape != base[1].shape or not np.allclose(changed[1], base[1])


def test_segment_mask_is_causal_within_segments_only(model):
  seg = jnp.asarray([[1, 1, 2, 2, 2, 3, 0, 0]])
  mask = np.asarray(model._full_mask(jnp.zeros_like(seg), None, seg))[0]  # pylint: disable=protected-access
  s = np.asarray(seg)[0]
  for q in range(8):
    for k in range(8):
      assert mask[q, k] == (k <= q and s[q] == s[k] and s[k] > 0), (q, k)
  np.testing.assert_array_equal(np.asarray(scoring.logprobs_from_hidden(
      jnp.ones((1, 8, 4)), jnp.ones((4, 5)), jnp.ones((1, 8), jnp.int32), None, segment_ids=seg)
                                           ) != 0, [[0, 1, 0, 1, 1, 0, 0, 0]])
  with pytest.raises(ValueError, match="attention_mask or segment_ids, not both"):
    model.hidden_states(jnp.ones((1, 8), jnp.int32), attention_mask=jnp.ones((1, 8)),
                        segment_ids=seg)


@pytest.mark.slow
def test_scorer_packed_equals_padded_and_prompt_embeddings_equal_alone(model):
  prompts, responses = _sequences(2)
  packed = SequenceScorer(model, pad_id=0, batch_size=2, row_len=16, seqs_per_row=4)
  padded = SequenceScorer(model, pad_id=0, batch_size=3, packing=False, pad_to=4)
  for a, b in zip(packed.token_logprobs(prompts, responses),
                  padded.token_logprobs(prompts, responses)):
    np.testing.assert_allclose(a, b, rtol=TOL, atol=TOL)
  (b,) = packing.pack(prompts, [[] for _ in prompts],
                      packing.PackingLayout(row_len=16, rows=2, seqs_per_row=8), pad_id=0)
  emb = np.asarray(scoring.packed_prompt_embeddings(model, jax.tree.map(jnp.asarray, b.rows),
                                                    b.seq_index.shape[0]))
  for s in np.flatnonzero(b.seq_index >= 0):
    p = jnp.asarray([prompts[int(b.seq_index[s])]])
    want = np.asarray(scoring.prompt_embeddings(model, p, jnp.ones_like(p)))[0]
    np.testing.assert_allclose(emb[s], want, rtol=TOL, atol=TOL)


# Shared prompts: prompt A's 5 responses (3, 0, 1, 6 and 2 tokens: an empty and a one-token one)
# need 5 + 12 > 16 tokens, so A is split into two units; prompt B's unit shares a row with one.
SHARED = [(0, 3), (0, 0), (0, 1), (0, 6), (0, 2), (1, 4), (1, 2)]
SHARED_PROMPT_LENS = (5, 3)


def _shared_sequences(seed=0, spec=SHARED):
  rng = np.random.default_rng(seed)
  heads = [rng.integers(3, 120, n).tolist() for n in SHARED_PROMPT_LENS]
  return [heads[g] for g, _ in spec], [rng.integers(3, 120, r).tolist() for _, r in spec]


def _shared_layout(**kw):
  return packing.PackingLayout(row_len=16, rows=2, seqs_per_row=4, share_prompts=True, **kw)


@pytest.mark.slow
def test_shared_prompt_logprobs_equal_unshared_and_alone(model):
  prompts, responses = _shared_sequences()
  (b,) = packing.pack(prompts, responses, _shared_layout(), pad_id=0)
  units = b.seq_index[(b.seq_index >= 0) & (b.prompt_slot == np.arange(len(b.seq_index)))]
  assert sorted(prompts[i] == prompts[0] for i in units) == [False, True, True]  # A split in two
  assert (b.rows.segment_ids.max(axis=1) == 2).any()  # two units in one row
  assert b.num_real_tokens < sum(len(p) + len(r) for p, r in zip(prompts, responses))
  shared = _by_layout(model, prompts, responses, _shared_layout())
  unshared = _by_layout(model, prompts, responses, packing.PackingLayout(row_len=16, rows=4,
                                                                         seqs_per_row=4))
  alone = _alone(model, prompts, responses)
  for i in range(len(prompts)):
    assert shared[i].shape == (len(responses[i]),)
    np.testing.assert_allclose(shared[i], unshared[i], rtol=TOL, atol=TOL)
    np.testing.assert_allclose(shared[i], alone[i], rtol=TOL, atol=TOL)


def test_a_response_never_attends_to_a_sibling_response(model):
  """Changing one response of a unit (its tokens, then its length) leaves its siblings' log-probs
  unchanged; its own change."""
  prompts, responses = _shared_sequences(1, [(1, 3), (1, 4), (1, 2)])
  layout = packing.PackingLayout(row_len=16, rows=1, seqs_per_row=4, share_prompts=True)
  assert packing.pack(prompts, responses, layout, pad_id=0)[0].rows.branch_ids.max() == 3
  base = _by_layout(model, prompts, responses, layout)
  for new in ([9, 10, 11, 12], [13, 14, 15, 16, 17, 18]):
    changed = _by_layout(model, prompts, responses[:1] + [new] + responses[2:], layout)
    for i in (0, 2):
      np.testing.assert_allclose(changed[i], base[i], rtol=1e-6, atol=1e-6)
    assert changed[1].shape != base[1].shape or not np.allclose(changed[1], base[1])


def test_shared_prompt_mask_and_predictors(model):
  """Query t sees key k iff k <= t in its unit and k is a prompt token or in t's own response; a
  response's first token is scored from its prompt's last state."""
  seg = jnp.asarray([[1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 0]])
  br = jnp.asarray([[0, 0, 1, 1, 2, 3, 3, 0, 1, 1, 0]])
  mask = np.asarray(model._full_mask(jnp.zeros_like(seg), None, seg, br))[0]  # pylint: disable=protected-access
  s, b = np.asarray(seg)[0], np.asarray(br)[0]
  for q in range(11):
    for k in range(11):
      want = k <= q and s[q] == s[k] > 0 and b[k] in (0, b[q])
      assert mask[q, k] == want, (q, k)
  np.testing.assert_array_equal(scoring.branch_predictors(seg, br)[0],
                                [0, 0, 1, 2, 1, 1, 5, 6, 7, 8, 9])
  with pytest.raises(ValueError, match="branch_ids .* need explicit positions"):
    model.hidden_states(jnp.ones((1, 11), jnp.int32), segment_ids=seg, branch_ids=br)


def test_shared_prompt_embeddings_reach_every_slot_of_a_unit(model):
  """`embed_packed` on a shared layout: every sequence of a unit gets its prompt's embedding."""
  from disa_jax.scoring.batched import embed_packed  # pylint: disable=g-import-not-at-top
  prompts, _ = _shared_sequences(2)
  fn = jax.jit(lambda rows: scoring.packed_prompt_embeddings(model, rows, 8))
  emb = embed_packed(fn, prompts, _shared_layout(), model.config.hidden_size, pad_id=0)
  for i, p in enumerate(prompts):
    p = jnp.asarray([p])
    want = np.asarray(scoring.prompt_embeddings(model, p, jnp.ones_like(p)))[0]
    np.testing.assert_allclose(emb[i], want, rtol=TOL, atol=TOL)
