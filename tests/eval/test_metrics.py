"""Mean@k, unbiased pass@k, maj@k and result tables."""

import itertools
import json
import math

import numpy as np
import pytest

from disa_jax import eval as ev


def _pass_at_k_bruteforce(n, c, k):
  """Probability that a uniformly random k-subset of n samples (c correct) holds a correct one."""
  samples = [1] * c + [0] * (n - c)
  subsets = list(itertools.combinations(range(n), k))
  return sum(any(samples[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n,c,k", [(1, 0, 1), (1, 1, 1), (5, 2, 1), (5, 2, 3), (8, 1, 8),
                                   (8, 0, 4), (10, 3, 5), (16, 16, 16), (12, 5, 7)])
def test_pass_at_k_equals_the_combinatorial_definition(n, c, k):
  want = 1.0 - math.comb(n - c, k) / math.comb(n, k)
  assert ev.pass_at_k(n, c, k) == pytest.approx(want, abs=1e-12)
  assert ev.pass_at_k(n, c, k) == pytest.approx(_pass_at_k_bruteforce(n, c, k), abs=1e-12)


def test_pass_at_1_is_the_mean_and_large_n_is_stable():
  rng = np.random.default_rng(0)
  correct = rng.random((50, 16)) < 0.3
  assert ev.pass_at_k_from_correct(correct, 1) == pytest.approx(correct.mean(), abs=1e-12)
  assert ev.pass_at_k_from_correct(correct, 16) == pytest.approx(correct.any(axis=1).mean())
  # Large n: the product form needs no big binomials.
  assert ev.pass_at_k(1000, 10, 100) == pytest.approx(
    1.0 - math.comb(990, 100) / math.comb(1000, 100), rel=1e-10)


def test_pass_at_k_validation():
  with pytest.raises(ValueError, match="k <= n"):
    ev.pass_at_k(4, 1, 5)
  with pytest.raises(ValueError, match="c <= n"):
    ev.pass_at_k(4, 5, 1)
  with pytest.raises(ValueError, match="ints"):
    ev.pass_at_k(4.0, 1, 1)


def test_mean_at_k():
  correct = np.array([[1, 0, 1, 1], [0, 0, 0, 0]])
  assert ev.mean_at_k(correct) == pytest.approx(3 / 8)
  assert ev.mean_at_k(correct.astype(bool)) == pytest.approx(3 / 8)
  with pytest.raises(ValueError, match=r"\[P, k\]"):
    ev.mean_at_k(np.zeros(4))
  with pytest.raises(ValueError, match="0/1"):
    ev.mean_at_k(np.full((2, 2), 0.5))


def test_maj_at_k():
  answers = [["2", "3", "3", None], ["5", "4", "5", "4"], [None, None, None, None],
             ["1", "1", "2", "2"]]
  correct = np.array([[0, 1, 1, 0], [1, 0, 1, 0], [0, 0, 0, 0], [0, 0, 1, 1]])
  # p0: majority 3 (correct); p1: tie 5/4 -> first (5, correct); p2: no answer;
  # p3: tie -> "1" (wrong).
  assert ev.maj_at_k(answers, correct) == pytest.approx(2 / 4)
  # First two samples only: p0 tie 2/3 -> "2" wrong; p1 tie -> "5" correct; p3 "1" wrong.
  assert ev.maj_at_k(answers, correct, k=2) == pytest.approx(1 / 4)
  with pytest.raises(ValueError, match="1 <= k"):
    ev.maj_at_k(answers, correct, k=5)


def test_tables(tmp_path):
  results = {"GRPO": {"AIME24": 0.1, "MATH500": 0.7},
             "DISA": {"AIME24": 0.2, "MATH500": 0.65, "AMC23": 0.5}}
  md = ev.markdown_table(results)
  lines = md.strip().splitlines()
  assert lines[0] == "| Method | AIME24 | MATH500 | AMC23 | Average |"
  assert lines[2] == "| GRPO | 10.0 | **70.0** | - | 40.0 |"
  assert lines[3] == "| DISA | **20.0** | 65.0 | **50.0** | **45.0** |"
  js = ev.results_json(results)
  assert js["DISA"]["average"] == pytest.approx((0.2 + 0.65 + 0.5) / 3)
  ev.write_results(results, str(tmp_path / "t.md"), str(tmp_path / "t.json"))
  assert (tmp_path / "t.md").read_text() == md
  assert json.loads((tmp_path / "t.json").read_text())["GRPO"]["AIME24"] == 0.1
  with pytest.raises(ValueError, match="empty"):
    ev.markdown_table({})
