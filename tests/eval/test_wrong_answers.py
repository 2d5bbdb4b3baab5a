"""`disa_jax.eval.wrong_answers`: the policy conditioned on a wrong answer, sampled exactly.

Tiers: P(correct | prefix) by hand; the sampler's next-token log-probs against teacher forcing; its
draws against the enumerated pi|w of a tiny model (chi-square over many draws); the conditional
estimator unbiased on an enumerable distribution, with far less noise than the plain one."""
import copy
import dataclasses

import numpy as np
import pytest
from flax import nnx
from scipy import stats

from disa_jax import codec, models
from disa_jax import config as config_lib
from disa_jax.eval import exact as X
from disa_jax.eval import wrong_answers as W
from disa_jax.pipeline import sum_models
from disa_jax.rewards.graded import Graded
from disa_jax.rollout.jax_sampler import JaxSampler
from disa_jax.scoring.batched import SequenceScorer
from disa_jax.tasks import get_task
from disa_jax.tasks.sum import SumTask, task_tokenizer

SPEC = sum_models.TinyLMSpec(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                             num_kv_heads=1, head_dim=16)


def test_p_correct_of_each_prefix_sums_the_answers_through_it():
  lp = {(1, 2, 9): np.log([0.5, 0.4, 0.9]), (1, 3, 9): np.log([0.5, 0.2, 0.5]),
        (4, 9): np.log([0.1, 0.7])}
  pre = W.CorrectPrefixes(list(lp), list(lp.values()))
  assert pre.p_correct(()) == pytest.approx(0.5 * 0.4 * 0.9 + 0.5 * 0.2 * 0.5 + 0.1 * 0.7)
  assert pre.p_correct((1,)) == pytest.approx(0.4 * 0.9 + 0.2 * 0.5)
  assert pre.p_correct((1, 2)) == pytest.approx(0.9)
  assert pre.p_correct((1, 2, 9)) == 1.0  # a complete correct answer
  assert pre.p_correct((5,)) == 0.0 and pre.p_correct((1, 2, 8)) == 0.0  # off every path
  logp = np.log(np.full(10, 0.1))
  got = pre.wrong_logits((1,), logp)
  want = logp.copy()
  want[2] += np.log(1 - 0.9)
  want[3] += np.log(1 - 0.5)
  np.testing.assert_allclose(got, want)
  # (1, 2) -> 9 completes a correct answer: never drawn; the other tokens keep pi(v | h)
  got = pre.wrong_logits((1, 2), logp)
  assert got[9] == -np.inf and np.all(got[:9] == logp[:9])
  with pytest.raises(ValueError, match=r"correct answer \(4, 9\) has 2 tokens but log-probs of "
                                       r"shape \(3,\)"):
    W.CorrectPrefixes([(4, 9)], [np.zeros(3)])


def _masses_one_by_one(answers, token_logprobs) -> dict:
  """P(correct | prefix) added answer by answer and prefix by prefix in Python floats: the
  reference the trie's vectorised sums are checked against (bit for bit)."""
  mass = {}
  for a, lp in zip(answers, token_logprobs):
    a, lp = tuple(a), np.asarray(lp, np.float64)
    suffix = np.concatenate([np.cumsum(lp[::-1])[::-1], [0.0]])
    for j in range(len(a) + 1):
      mass[a[:j]] = mass.get(a[:j], 0.0) + float(np.exp(suffix[j]))
  return mass


def test_the_trie_gives_every_prefix_the_masses_added_one_by_one_bit_for_bit():
  """Random answer sets sharing prefixes (lengths 1-7, a vocabulary of 4 so that paths merge),
  float32 log-probs as the scorer returns them: every prefix's P(correct | prefix) equals the
  one-by-one sum exactly, and one trie serves new log-probs (the tracker's every measurement)."""
  rng = np.random.default_rng(0)
  for trial in range(20):
    answers = sorted({tuple(rng.integers(0, 4, size=rng.integers(1, 8)).tolist())
                      for _ in range(rng.integers(1, 60))})
    trie = W.PrefixTrie(answers)
    for _ in range(2):
      lp = [np.log(rng.uniform(0.05, 1.0, size=len(a))).astype(np.float32) for a in answers]
      pre = W.CorrectPrefixes(answers, lp, trie=trie)
      want = _masses_one_by_one(answers, lp)
      assert set(trie.index) == set(want), trial
      for prefix, m in want.items():
        assert pre.p_correct(prefix) == min(m, 1.0), (trial, prefix)
  with pytest.raises(ValueError, match="PrefixTrie of 1 answers for 2 answers"):
    W.CorrectPrefixes([(1,), (2,)], [np.zeros(1), np.zeros(1)], trie=W.PrefixTrie([(1,)]))


def test_a_prefix_whose_every_token_rounds_to_zero_wrong_mass_samples_off_the_paths():
  # P(correct | (7,)) = 1 through both tokens on a path (rounded): only tokens off them remain
  pre = W.CorrectPrefixes([(7, 1), (7, 2)], [np.log([0.5, 1.0]), np.log([0.5, 1.0])])
  logp = np.log(np.asarray([0.0, 0.6, 0.4, 0.0]) + 1e-30)
  got = pre.wrong_logits((7,), logp)
  assert got[1] == got[2] == -np.inf and np.all(np.isfinite(got[[0, 3]]))


@pytest.fixture(scope="module")
def tiny():
  tok = task_tokenizer()
  model = models.Transformer(sum_models.model_config(tok, SPEC), rngs=nnx.Rngs(3))
  return tok, SequenceScorer(model, pad_id=tok.pad_token_id, batch_size=64)


def test_next_token_logprobs_are_the_teacher_forced_ones(tiny):
  tok, scorer = tiny
  rng = np.random.default_rng(0)
  prompts = [list(rng.integers(4, 100, n)) for n in (3, 5, 4)]
  responses = [list(rng.integers(4, 100, n)) for n in (4, 2, 3)]
  want = scorer.token_logprobs(prompts, responses)
  width = max(len(p) for p in prompts)
  for j in range(3):
    rows = [p for p, r in zip(prompts, responses) if j < len(r)]
    resp = [r[:j] for r in responses if j < len(r)]
    ids = np.zeros((len(rows), width + 4), np.int32)
    mask = np.zeros_like(ids)
    for i, (p, r) in enumerate(zip(rows, resp)):
      seq = p + r
      ids[i, width - len(p):width - len(p) + len(seq)] = seq
      mask[i, width - len(p):width - len(p) + len(seq)] = 1
    got = scorer.next_token_logprobs(ids, mask, np.asarray([width + j - 1] * len(rows)))
    nxt = [r[j] for r in responses if j < len(r)]
    ref = [w[j] for w, r in zip(want, responses) if j < len(r)]
    np.testing.assert_allclose(got[np.arange(len(nxt)), nxt], ref, atol=2e-5)
    np.testing.assert_allclose(np.exp(got).sum(-1), 1.0, atol=1e-5)


def _enumerated(scorer, prompt, stop):
  """``{outcome: pi(outcome)}`` over every response of at most 2 tokens."""
  lp0 = scorer.next_token_logprobs(np.asarray([prompt]), np.ones((1, len(prompt))),
                                   np.asarray([len(prompt) - 1]))[0].astype(np.float64)
  firsts = [v for v in range(lp0.size) if v != stop]
  ids = np.asarray([prompt + [v] for v in firsts])
  lp1 = scorer.next_token_logprobs(ids, np.ones_like(ids), np.full(len(firsts), len(prompt)))
  out = {(stop,): np.exp(lp0[stop])}
  for v, row in zip(firsts, lp1.astype(np.float64)):
    out.update({(v, u): np.exp(lp0[v] + row[u]) for u in range(row.size)})
  return out


def test_the_draws_follow_the_policy_conditioned_on_a_wrong_answer(tiny):
  """Against the enumerated pi|w of a tiny model; a sampler that ignored the correct set (plain
  pi) would draw correct answers and put ~1/P(correct | a) too much mass on the first token a."""
  tok, scorer = tiny
  prompt, stop = tok.encode("sum to 3:", add_special_tokens=False), tok.eos_token_id
  pi = _enumerated(scorer, prompt, stop)
  first = {}
  for o, p in pi.items():
    first[o[0]] = first.get(o[0], 0.0) + p
  a = max(first, key=first.get)  # the likeliest first token: most of its continuations correct
  correct = [(a, u) for u in range(0, 108, 2)] + [(stop,)]
  lp = [np.log([first[c[0]], pi[c] / first[c[0]]]) if len(c) == 2 else np.log([pi[c]])
        for c in correct]
  pre = W.CorrectPrefixes(correct, lp)
  cset = set(correct)
  pw = 1.0 - sum(pi[c] for c in correct)
  assert pre.p_correct(()) == pytest.approx(1.0 - pw, rel=1e-5)
  n = 8000
  drawn, lp_drawn = W.sample_wrong(scorer, [prompt], [pre], n, max_tokens=2, stop_ids=(stop,),
                                   pad_id=tok.pad_token_id, rng=np.random.default_rng(1))
  drawn = drawn[0]
  # log pi of each draw from the decoding passes: the teacher-forced one
  np.testing.assert_allclose(lp_drawn[0, :50], scorer.sequence_logprobs([prompt] * 50, drawn[:50]),
                             atol=1e-4)
  assert len(drawn) == n and not any(tuple(o) in cset for o in drawn)
  # the first token's law under pi|w, and the second token's after a (chi-square, bins >= 5)
  q_first = {v: sum(p for o, p in pi.items() if o[0] == v and o not in cset) / pw for v in first}
  q_after_a = {u: pi[(a, u)] for u in range(108) if (a, u) not in cset}
  for law, seen in ((q_first, [o[0] for o in drawn]),
                    (q_after_a, [o[1] for o in drawn if o[0] == a])):
    keys = sorted(law)
    exp = np.asarray([law[k] for k in keys]) / sum(law.values()) * len(seen)
    obs = np.asarray([seen.count(k) for k in keys], np.float64)
    assert obs[exp == 0].sum() == 0  # nothing drawn where pi|w has no mass
    e, o = [0.0], [0.0]  # consecutive tokens grouped into bins of >= 5 expected draws
    for ex, ob in zip(exp, obs):
      if e[-1] >= 5:
        e.append(0.0), o.append(0.0)
      e[-1], o[-1] = e[-1] + ex, o[-1] + ob
    assert len(e) >= 5, e  # the test has bins to compare
    assert stats.chisquare(o, e).pvalue > 1e-3, (o, e)
  # the first token a keeps about half of pi(a) / P_w (its correct continuations are excluded):
  # drawn as often as that, not as pi(a) / P_w
  seen_a, sd = sum(1 for o in drawn if o[0] == a), np.sqrt(n * q_first[a])
  assert abs(seen_a - n * q_first[a]) < 4 * sd < n * (first[a] / pw - q_first[a]), (seen_a, sd)


# Six outcomes, the first two correct (as in test_exact_terms): P_w = 0.03.
POLICY = np.asarray([0.55, 0.42, 0.015, 0.01, 0.004, 0.001])
REF = np.asarray([0.3, 0.3, 0.1, 0.1, 0.1, 0.1])


def test_the_conditional_estimator_is_unbiased_and_far_less_noisy_than_the_plain_one():
  pc, pc_ref, k, repeats = POLICY[:2].sum(), REF[:2].sum(), 8, 4000
  pw, pw_ref = 1 - pc, 1 - pc_ref
  cond_p = POLICY[2:] / pw
  truth = float(pw * np.sum(cond_p * np.log(cond_p / (REF[2:] / pw_ref))))
  rng = np.random.default_rng(0)
  cond = []
  for _ in range(repeats):
    idx = 2 + rng.choice(4, size=k, p=cond_p)
    cond.append(W.conditional_wrong_term(np.log(POLICY[idx]), np.log(REF[idx]), pc, pc_ref))
  cond = np.asarray(cond)
  mean, se = cond[:, 0].mean(), cond[:, 0].std(ddof=1) / np.sqrt(repeats)
  assert abs(mean - truth) < 4 * se, (mean, truth, se)
  assert np.sqrt(np.mean(cond[:, 1] ** 2)) == pytest.approx(cond[:, 0].std(), rel=0.1)
  assert cond[:, 2].mean() == pytest.approx(truth / pw, rel=0.05)  # KL(pi|w || pi~|w)
  plain = []
  for _ in range(repeats):
    idx = rng.choice(6, size=k, p=POLICY)
    plain.append(X.wrong_term(np.log(POLICY[idx]), np.log(REF[idx]), (idx < 2).astype(float), pc,
                              pc_ref)[0])
  assert np.std(plain) > 10 * cond[:, 0].std()  # same k: every conditional draw informs the term


def test_the_conditional_term_is_zero_without_wrong_mass_and_refused_where_pi_ref_has_none():
  assert W.conditional_wrong_term(np.zeros(2), np.zeros(2), 1.0, 0.5)[:2] == (0.0, 0.0)
  with pytest.raises(ValueError, match=r"P_ref\(wrong\) = 0.0"):
    W.conditional_wrong_term(np.zeros(2), np.zeros(2), 0.9, 1.0)


def test_wrong_samples_must_be_zero_or_at_least_two():
  with pytest.raises(ValueError, match="exact_target.wrong_samples must be 0 \\(off\\) or an int "
                                       ">= 2, got 1"):
    X.ExactTargetConfig(wrong_samples=1)


@pytest.fixture(scope="module")
def sum_tracker():
  """The sum task's exact tracker of two prompts with 6 conditional wrong samples each, a tiny
  random policy served by the JAX sampler and scored by its own scorer."""
  tok = task_tokenizer()
  ref = models.Transformer(sum_models.model_config(tok, SPEC), rngs=nnx.Rngs(0))
  policy = models.Transformer(sum_models.model_config(tok, SPEC), rngs=nnx.Rngs(1))
  cfg = X.ExactTargetConfig(beta=2.0, kl_samples=4, wrong_samples=6, seed=5)
  prompts = [tok.encode(SumTask().prompt(n), add_special_tokens=False) for n in (2, 3)]
  tracker = get_task("sum_task").measures(cfg, tok, prompts, [{"ground_truth": 2},
                                                              {"ground_truth": 3}],
                                          lambda: cfg.scorer(ref, tok.pad_token_id), max_tokens=8)
  return tracker, JaxSampler(policy), cfg.scorer(policy, tok.pad_token_id)


def test_the_tracker_takes_the_wrong_answer_term_from_the_conditional_samples(sum_tracker):
  tracker, engine, scorer = sum_tracker
  out = tracker.measure(engine, scorer, step=3)
  assert out.wrong_samples_per_prompt == 6 and out.to_json()["wrong_samples_per_prompt"] == 6
  for p in out.per_prompt:
    assert np.isfinite(p["kl_wrong"]) and p["kl_wrong"] >= 0 and p["p_wrong_kl_wrong_se"] > 0
    assert p["p_wrong_kl_wrong"] == pytest.approx(p["kl_wrong"] * (1 - p["p_correct"]))
    assert p["kl_decomposed"] == pytest.approx(p["kl_binary"] + p["p_correct"] * p["kl_correct"]
                                               + p["p_wrong_kl_wrong"])
  again = tracker.measure(engine, scorer, step=3)
  later = tracker.measure(engine, scorer, step=4)
  assert again["kl_decomposed"] == out["kl_decomposed"] != later["kl_decomposed"]
  # measures written without the conditional samples keep their stored form
  plain = X.ExactMeasures(per_prompt=(), samples_per_prompt=4, means=out.means)
  assert "wrong_samples_per_prompt" not in plain.to_json()
  assert codec.decode(X.ExactMeasures, plain.to_json(), "m.json") == plain


def test_shared_prompt_scorers_give_the_same_measures(sum_tracker):
  """ExactTargetConfig.share_prompts: the correct sets and samples scored with one copy of each
  prompt per row; the same measures from the same seeds, up to float32 rounding."""
  tracker, engine, scorer = sum_tracker
  tok = task_tokenizer()
  ref = models.Transformer(sum_models.model_config(tok, SPEC), rngs=nnx.Rngs(0))
  policy = models.Transformer(sum_models.model_config(tok, SPEC), rngs=nnx.Rngs(1))
  cfg = dataclasses.replace(tracker.cfg, share_prompts=True)
  assert cfg.scorer(policy, tok.pad_token_id).share_prompts and not scorer.share_prompts
  shared = get_task("sum_task").measures(cfg, tok, tracker.prompts, tracker.metas,
                                         lambda: cfg.scorer(ref, tok.pad_token_id), max_tokens=8)
  a = tracker.measure(engine, scorer, step=3).to_json(per_prompt=False)
  b = shared.measure(engine, cfg.scorer(policy, tok.pad_token_id), step=3).to_json(per_prompt=False)
  assert set(a) == set(b)
  for k in a:
    assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-6), k
  # recorded only where set: a config without it writes what it wrote before the field existed
  assert "share_prompts" not in config_lib.to_dict(tracker.cfg)
  assert config_lib.to_dict(cfg)["share_prompts"] is True


def test_fewer_scoring_rows_per_pass_give_the_same_measures(sum_tracker):
  """ExactTargetConfig.scorer_rows: the tracker's scorers run that many packed rows per pass; the
  same measures from the same seeds up to float32 rounding, the field recorded only where set, and
  a row count below 1 refused naming the field."""
  tracker, engine, scorer = sum_tracker
  tok = task_tokenizer()
  ref = models.Transformer(sum_models.model_config(tok, SPEC), rngs=nnx.Rngs(0))
  policy = models.Transformer(sum_models.model_config(tok, SPEC), rngs=nnx.Rngs(1))
  cfg = dataclasses.replace(tracker.cfg, scorer_rows=1)
  small = cfg.scorer(policy, tok.pad_token_id)
  assert (small.batch_size, scorer.batch_size) == (1, 64)
  fewer = get_task("sum_task").measures(cfg, tok, tracker.prompts, tracker.metas,
                                        lambda: cfg.scorer(ref, tok.pad_token_id), max_tokens=8)
  assert len(fewer.ref_scorer.pack(fewer._flat_p, fewer._flat_c).batches) > 1  # several passes
  a = tracker.measure(engine, scorer, step=3).to_json(per_prompt=False)
  b = fewer.measure(engine, small, step=3).to_json(per_prompt=False)
  assert set(a) == set(b)
  for k in a:
    assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-6), k
  assert "scorer_rows" not in config_lib.to_dict(tracker.cfg)
  assert config_lib.to_dict(cfg)["scorer_rows"] == 1
  with pytest.raises(ValueError, match=r"exact_target.scorer_rows must be an int >= 1, got 0"):
    X.ExactTargetConfig(scorer_rows=0)


def test_a_draw_the_grader_accepts_is_an_error_naming_it(sum_tracker):
  tracker, engine, scorer = sum_tracker
  lenient = copy.copy(tracker)
  lenient.reward_fn = lambda responses, metas: Graded.ok(np.ones(len(responses)))
  with pytest.raises(ValueError, match=r"of prompt 0 \(meta \{'ground_truth': 2\}\), is graded "
                                       "correct: the task's correct set misses an answer its "
                                       "grader accepts"):
    lenient.measure(engine, scorer, step=3)


def test_the_cached_decode_draws_the_same_wrong_samples(sum_tracker):
  """ExactTargetConfig.wrong_decode='cached': the conditional samples decoded through a KV cache;
  the same draws from the same seed (their distributions agree to float32 rounding) and the same
  measures."""
  tracker, engine, scorer = sum_tracker
  cached = copy.copy(tracker)
  cached.cfg = dataclasses.replace(tracker.cfg, wrong_decode="cached")
  a = tracker.measure(engine, scorer, step=5).to_json(per_prompt=False)
  b = cached.measure(engine, scorer, step=5).to_json(per_prompt=False)
  for k in a:
    assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-6), k
  assert "wrong_decode" not in config_lib.to_dict(tracker.cfg)
  with pytest.raises(ValueError, match=r"exact_target.wrong_decode must be one of \('full', "
                                       r"'cached'\), got 'kv'"):
    X.ExactTargetConfig(wrong_decode="kv")
