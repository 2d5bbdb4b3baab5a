"""The synthetic sum task: canonical verifier, enumeration and the exact partition function."""
import numpy as np
import pytest

from disa_jax.eval.exact import exact_log_z
from disa_jax.tasks.sum import SumTask, make_tokenizer


@pytest.fixture(scope="module")
def tok():
  return make_tokenizer()


def test_tokenizer_is_char_level_for_answers(tok):
  ids = tok.encode(" 12+3", add_special_tokens=False)
  assert len(ids) == 5 and tok.decode(ids) == " 12+3"
  p = tok.encode(SumTask().prompt(7), add_special_tokens=False)
  assert len(p) < 20 and tok.decode(p) == "Give two non-negative integers that sum to 7:"
  assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)


def test_reward_accepts_exactly_the_enumerated_answers(tok):
  task = SumTask(0, 12)
  eos = tok.eos_token_id
  enc = lambda s: tok.encode(s, add_special_tokens=False)
  for n in (0, 5, 12):
    correct = task.correct_completions(tok, n)
    assert len(correct) == n + 1 and len({tuple(c) for c in correct}) == n + 1
    assert all(task.reward(tok, n, c) == 1.0 for c in correct)
  assert task.reward(tok, 5, enc(" 2+3")) == 0.0  # no EOS
  assert task.reward(tok, 5, enc(" 2+4") + [eos]) == 0.0  # wrong sum
  assert task.reward(tok, 5, enc(" 02+3") + [eos]) == 0.0  # leading zero
  assert task.reward(tok, 5, enc("2+3") + [eos]) == 0.0  # no leading space
  assert task.reward(tok, 5, enc(" 2 3") + [eos]) == 0.0  # other format
  assert task.reward(tok, 5, enc(" 2+3") + [eos, eos]) == 0.0  # trailing tokens
  assert task.reward(tok, 5, []) == 0.0
  with pytest.raises(ValueError, match="n_min"):
    SumTask(5, 2)


def test_exact_log_z_matches_brute_force():
  rng = np.random.default_rng(0)
  beta = 3.0
  for n in (0, 3, 9):
    lp = np.log(rng.dirichlet(np.ones(n + 5))[: n + 1])  # part of a distribution on the correct answers
    brute = np.log(1 - np.exp(lp).sum() + np.exp(lp).sum() * np.exp(beta))
    log_p_correct = np.logaddexp.reduce(lp)  # the exact evaluator's input: log P_ref(correct)
    assert exact_log_z(np.array([log_p_correct]), beta)[0] == pytest.approx(brute, rel=1e-10)
  assert exact_log_z(np.array([-1e4]), 15.0)[0] == pytest.approx(0.0, abs=1e-6)  # P(correct) ~ 0 -> log Z = 0
