"""The JAX sampler: sampled distribution, reported log-probs, determinism, buckets, weight updates."""

import dataclasses

import numpy as np
import pytest
import scipy.stats

from disa_jax import models
from disa_jax.rollout import SamplingParams
from disa_jax.rollout.jax_sampler import JaxSampler
from disa_jax.rollout.sampling import process_logits
from tests.rollout import reference, stop_case

PROMPTS = [[1, 5, 6, 7], [1, 9], [1, 20, 30, 40, 50, 60, 70]]


@pytest.fixture(scope="module")
def sampler(tiny_ckpt):
  return JaxSampler.from_pretrained(tiny_ckpt)


def test_process_logits_matches_numpy_reference():
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(4, 50)).astype(np.float32) * 3
  for t, k, p in [(1.0, 0, 1.0), (0.7, 0, 0.9), (1.3, 10, 1.0), (0.5, 5, 0.6), (2.0, 0, 0.3)]:
    got = np.asarray(process_logits(logits, np.float32(t), np.int32(k), np.float32(p)))
    for b in range(4):
      ref = reference.processed_logprobs_np(logits[b], t, k, p)
      np.testing.assert_array_equal(np.isfinite(got[b]), np.isfinite(ref))
      np.testing.assert_allclose(got[b][np.isfinite(ref)], ref[np.isfinite(ref)], atol=1e-5)


def test_first_token_frequencies_match_truncated_softmax(sampler):
  """Chi-square: 1024 samples of the first token vs softmax(logits / T) after top-p."""
  prompt, t, top_p, n = [1, 5, 6, 7], 1.5, 0.8, 1024
  out = sampler.generate([prompt], SamplingParams(n=n, temperature=t, top_p=top_p, max_tokens=1,
                                                  seed=11))
  first = np.array([c.token_ids[0] for c in out[0]])
  logits = reference.next_token_logits(sampler.model, prompt)
  ref_lp = reference.processed_logprobs_np(logits, t, 0, top_p)
  kept = np.flatnonzero(np.isfinite(ref_lp))
  assert set(first.tolist()) <= set(kept.tolist()), "sampled a token outside the top-p set"
  assert len(kept) >= 5, f"degenerate test distribution: only {len(kept)} tokens kept"
  counts = np.array([(first == v).sum() for v in kept])
  expected = np.exp(ref_lp[kept]) * n
  _, pvalue = scipy.stats.chisquare(counts, expected * counts.sum() / expected.sum())
  assert pvalue > 1e-3, f"chi-square p-value {pvalue}"
  # The reported log-prob of each sample is that of the truncated distribution.
  lps = np.array([c.logprobs[0] for c in out[0]])
  np.testing.assert_allclose(lps, ref_lp[first], atol=1e-5)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 20, 0.9), (1.2, 0, 0.5)])
def test_reported_logprobs_equal_teacher_forced_recomputation(sampler, temperature, top_k, top_p):
  params = SamplingParams(n=2, temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=12,
                          seed=5, return_raw_logprobs=True)
  out = sampler.generate(PROMPTS, params)
  for prompt, comps in zip(PROMPTS, out):
    for c in comps:
      assert c.finish_reason == "length" and len(c.token_ids) == 12
      logits = reference.teacher_forced_logits(sampler.model, prompt, c.token_ids)
      ref = np.array([reference.processed_logprobs_np(l, temperature, top_k, top_p)[tok]
                      for l, tok in zip(logits, c.token_ids)])
      np.testing.assert_allclose(c.logprobs, ref, atol=1e-5)
      raw = reference.raw_logprobs_ref(sampler.model, prompt, c.token_ids)
      np.testing.assert_allclose(c.raw_logprobs, raw, atol=1e-5)


def test_greedy_is_argmax_with_zero_logprobs(sampler):
  out = sampler.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=10,
                                                 return_raw_logprobs=True))
  for prompt, (c,) in zip(PROMPTS, out):
    logits = reference.teacher_forced_logits(sampler.model, prompt, c.token_ids)
    np.testing.assert_array_equal(c.token_ids, logits.argmax(-1))
    np.testing.assert_array_equal(c.logprobs, 0.0)
    assert c.raw_logprobs is not None and np.all(c.raw_logprobs < 0)


def test_seed_determinism_and_independent_samples(sampler):
  params = SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=7)
  a = sampler.generate(PROMPTS, params)
  b = sampler.generate(PROMPTS, params)
  c = sampler.generate(PROMPTS, SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=8))
  flat = lambda out: [x.token_ids.tolist() for per in out for x in per]
  assert flat(a) == flat(b)
  assert flat(a) != flat(c)
  assert len({tuple(x) for x in flat(a)}) == len(flat(a)), "samples of one prompt coincide"
  # A prompt's samples do not depend on the prompts after it in the request.
  first = sampler.generate(PROMPTS[:1], params)
  assert [x.token_ids.tolist() for x in first[0]] == [x.token_ids.tolist() for x in a[0]]
  # A slice of the request with its prompt_index_offset samples what the whole request did.
  tail = sampler.generate(PROMPTS[1:], dataclasses.replace(params, prompt_index_offset=1))
  assert flat(tail) == flat(a[1:])
  assert flat(sampler.generate(PROMPTS[1:], params)) != flat(a[1:])


def test_stop_tokens_and_early_exit(sampler):
  greedy = sampler.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12))
  # Stop at each prompt's 3rd greedy token: completions end there, including the stop token.
  stops = tuple(int(g[0].token_ids[2]) for g in greedy)
  out = sampler.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12,
                                                 stop_token_ids=stops))
  for g, (c,) in zip(greedy, out):
    ids = g[0].token_ids.tolist()
    cut = min(i for i, t in enumerate(ids) if t in stops) + 1
    assert c.token_ids.tolist() == ids[:cut]
    assert c.finish_reason == "stop"
  # Every row stops at its first token: the decode loop exits after one step, not max_tokens.
  every = tuple(range(sampler.vocab_size))
  out = sampler.generate(PROMPTS, SamplingParams(max_tokens=16, stop_token_ids=every))
  assert all(len(c.token_ids) == 1 and c.finish_reason == "stop" for per in out for c in per)
  assert sampler.last_num_steps == 1
  sampler.generate(PROMPTS, SamplingParams(max_tokens=13))
  assert sampler.last_num_steps == 13


def test_stops_at_the_generation_config_eos(sampler, tmp_path):
  """Tokenizer eos 2, generation_config eos another token: sampling ends at the latter."""
  stop_case.check_engine_stops_at_generation_config_eos(sampler, str(tmp_path / "tok"))


def test_new_prompt_lengths_and_params_do_not_recompile(sampler):
  s = sampler
  s.generate(PROMPTS, SamplingParams(max_tokens=10))
  compiled = {k: f._cache_size() for k, f in s._fns.items()}  # pylint: disable=protected-access
  for prompt_len, n, t, k, p in [(3, 1, 1.0, 0, 1.0), (9, 1, 0.5, 5, 0.9), (15, 1, 0.0, 0, 1.0),
                                 (1, 1, 2.0, 0, 0.3)]:
    prompts = [list(range(1, prompt_len + 1)), [4, 5], [7]]
    s.generate(prompts, SamplingParams(n=n, temperature=t, top_k=k, top_p=p, max_tokens=10,
                                       stop_token_ids=(prompt_len,)))
  assert {k: f._cache_size() for k, f in s._fns.items()} == compiled  # pylint: disable=protected-access


@pytest.mark.slow
@pytest.mark.parametrize("layout,key", [("ragged", ("ragged", 16, 4, 4, 16)),
                                        ("dense", ("dense", 16, 4))])
def test_samples_of_a_prompt_share_one_prefill(tiny_ckpt, layout, key):
  """n = 4 samples of 3 prompts (12 rows on 16 slots) prefill each prompt once, on either path;
  greedy completions and their raw log-probs equal those of the prompts repeated n times with
  n = 1 (one prefill per row)."""
  sampler = JaxSampler.from_pretrained(tiny_ckpt, cache_layout=layout)
  params = SamplingParams(n=4, temperature=0.0, max_tokens=6, return_raw_logprobs=True)
  grouped = sampler.generate(PROMPTS, params)
  assert key in sampler._fns  # pylint: disable=protected-access  (group 4)
  flat = sampler.generate([p for p in PROMPTS for _ in range(4)], dataclasses.replace(params, n=1))
  for i, comps in enumerate(grouped):
    for j, c in enumerate(comps):
      (ref,) = flat[4 * i + j]
      np.testing.assert_array_equal(c.token_ids, ref.token_ids)
      np.testing.assert_allclose(c.raw_logprobs, ref.raw_logprobs, atol=1e-5)


def test_update_weights_changes_and_restores_bit_for_bit(sampler, hf_state):
  s = sampler
  params = SamplingParams(n=2, temperature=0.9, max_tokens=10, seed=3, return_raw_logprobs=True)
  before = s.generate(PROMPTS, params)
  rng = np.random.default_rng(0)
  perturbed = {k: v + 0.5 * rng.standard_normal(v.shape).astype(v.dtype) * v.std()
               for k, v in hf_state.items()}
  try:
    s.update_weights(perturbed)
    during = s.generate(PROMPTS, params)
  finally:
    s.update_weights(hf_state)
  assert any(not np.array_equal(a.token_ids, b.token_ids)
             for pa, pb in zip(before, during) for a, b in zip(pa, pb))
  s.update_weights(hf_state)
  reference.assert_same_completions(s.generate(PROMPTS, params), before)
  with pytest.raises(ValueError):
    s.update_weights({k: v for k, v in hf_state.items() if "layers.0." not in k})


def test_bad_inputs_raise(sampler):
  with pytest.raises(ValueError, match="prompt_token_ids\\[1\\]"):
    sampler.generate([[1, 2], []], SamplingParams())
  with pytest.raises(ValueError, match="outside"):
    sampler.generate([[1, 10_000]], SamplingParams())
  with pytest.raises(ValueError, match="stop_token_ids"):
    sampler.generate([[1]], SamplingParams(stop_token_ids=(10_000,)))
  with pytest.raises(ValueError, match="top_p"):
    SamplingParams(top_p=0.0)
  with pytest.raises(ValueError, match="temperature"):
    SamplingParams(temperature=-1.0)
  with pytest.raises(ValueError, match="max_tokens"):
    SamplingParams(max_tokens=0)
  assert models is not None
