import jax
import jax.numpy as jnp
import numpy as np
import pytest

from disa_jax.data import packing
from disa_jax.scoring import token_logprobs
from disa_jax.scoring.batched import SequenceScorer
from disa_jax.testing import make_tiny_model


@pytest.mark.slow
def test_scorer_matches_unpadded_scoring_and_updates():
  model = make_tiny_model("qwen3", seed=0)
  prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]
  responses = [[20, 21], [22, 23, 24, 25], [26], []]
  scorer = SequenceScorer(model, pad_id=0, batch_size=3, pad_to=4)
  per_tok = scorer.token_logprobs(prompts, responses)
  seq = scorer.sequence_logprobs(prompts, responses)
  for i, (p, r) in enumerate(zip(prompts, responses)):
    ids = jnp.asarray([p + r])
    ref = np.asarray(token_logprobs(model, ids, jnp.ones_like(ids)))[0, len(p):]
    np.testing.assert_allclose(per_tok[i], ref, rtol=1e-5, atol=1e-5)
    assert seq[i] == np.float64(ref.sum()) or abs(seq[i] - ref.sum()) < 1e-4
  assert per_tok[3].shape == (0,) and seq[3] == 0.0
  other = make_tiny_model("qwen3", seed=1)
  scorer.update(other)
  ids = jnp.asarray([prompts[0] + responses[0]])
  ref = np.asarray(token_logprobs(other, ids, jnp.ones_like(ids)))[0, 3:]
  np.testing.assert_allclose(scorer.token_logprobs(prompts[:1], responses[:1])[0], ref, rtol=1e-5, atol=1e-5)


def test_a_kept_packing_is_reused_while_its_layout_holds_and_scores_as_a_fresh_one():
  """The exact tracker packs its correct sets once (`SequenceScorer.pack` with ``reuse``): new
  weights score the kept packing bit for bit as a fresh call; once the scorer's rows have grown
  (a longer sequence scored since), the kept packing is not this call's layout and is packed
  anew."""
  prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]
  responses = [[20, 21], [22, 23, 24, 25], [26], []]
  scorer = SequenceScorer(make_tiny_model("qwen3", seed=0), pad_id=0, batch_size=3)
  kept = scorer.pack(prompts, responses)
  scorer.update(make_tiny_model("qwen3", seed=1))
  assert scorer.pack(prompts, responses, reuse=kept) is kept
  for a, b in zip(scorer.token_logprobs_packed(kept), scorer.token_logprobs(prompts, responses)):
    assert a.dtype == np.float32 and np.array_equal(a, b)
  scorer.token_logprobs([[1] * 40], [[2] * 40])  # 80 tokens: rows grow from 64 to 128
  again = scorer.pack(prompts, responses, reuse=kept)
  assert again is not kept and again.layout.row_len == 128 and kept.layout.row_len == 64
  other_pad = SequenceScorer(make_tiny_model("qwen3", seed=0), pad_id=3, batch_size=3)
  assert other_pad.pack(prompts, responses, reuse=kept) is not kept


def test_shared_prompts_give_the_log_probs_of_one_copy_per_sequence_in_fewer_rows():
  """share_prompts: each prompt's sequences read one copy of its tokens per row (the exact
  tracker's correct sets: many answers to one prompt); the log-probs are the unshared ones."""
  model = make_tiny_model("qwen3", seed=0)
  rng = np.random.default_rng(0)
  prompts = [list(rng.integers(3, 60, size=int(rng.integers(4, 9)))) for _ in range(6)]
  flat_p = [p for p in prompts for _ in range(9)]
  flat_r = [list(rng.integers(3, 60, size=int(rng.integers(1, 6)))) for _ in flat_p]
  plain = SequenceScorer(model, pad_id=0, batch_size=4, row_len=32)
  shared = SequenceScorer(model, pad_id=0, batch_size=4, row_len=32, share_prompts=True)
  assert shared.layout(np.asarray([8])).share_prompts and not plain.layout(np.asarray([8])).share_prompts
  for a, b in zip(plain.token_logprobs(flat_p, flat_r), shared.token_logprobs(flat_p, flat_r)):
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)
  lengths = packing.sequence_lengths(flat_p, flat_r)
  real = lambda s: sum(b.rows.segment_ids.astype(bool).sum() for b in packing.pack(
      flat_p, flat_r, s.layout(lengths), pad_id=0))
  assert real(plain) == sum(len(p) + len(r) for p, r in zip(flat_p, flat_r))
  assert real(shared) < real(plain) - 2 * sum(len(p) for p in prompts)  # >= 3 copies saved each
  # without packing there is no row to share: the option is off
  assert not SequenceScorer(model, pad_id=0, packing=False, share_prompts=True).layout(
      np.asarray([8])).share_prompts


def test_the_cached_decoder_gives_the_next_token_log_probs_of_the_whole_buffer():
  """CachedDecoder: the prompts once, then one token per row through the KV cache; at every step
  each row's next-token distribution is next_token_logprobs' over the whole left-padded buffer
  (rows of several prompt lengths, over two chunks of rows)."""
  model = make_tiny_model("qwen3", seed=0)
  scorer = SequenceScorer(model, pad_id=0, batch_size=2)  # chunks of 8 rows: 11 rows, 2 chunks
  rng = np.random.default_rng(1)
  width, new = 6, 4
  lens = rng.integers(1, width + 1, size=11)
  ids = np.zeros((11, width + new), np.int32)
  mask = np.zeros_like(ids)
  for r, n in enumerate(lens):
    ids[r, width - n:width] = rng.integers(3, 60, size=n)
    mask[r, width - n:width] = 1
  decoder = scorer.decoder(ids[:, :width], mask[:, :width], new)
  for t in range(new):
    if t:
      ids[:, width + t - 1] = rng.integers(3, 60, size=11)
      mask[:, width + t - 1] = 1
      decoder.step(ids[:, width + t - 1])
    full = scorer.next_token_logprobs(ids, mask, np.full(11, width + t - 1))
    np.testing.assert_allclose(decoder.logprobs, full, rtol=1e-5, atol=1e-5)
  before = jax.tree.leaves(decoder._chunks[0][0])
  decoder.step(ids[:, 0])  # the 4th token appended: the cache's last slot
  assert all(leaf.is_deleted() for leaf in before)  # donated: each step updates the one cache
  with pytest.raises(ValueError, match="holds 4 new tokens; step 5 is one more"):
    decoder.step(ids[:, 0])
