"""Math reward: math-verify grading with normalisations, and the time-bounded worker pool."""

import json
import os
import pathlib
import re
import time

import numpy as np
import pytest

from disa_jax import rewards
from disa_jax.data import load_prompts
from disa_jax.rewards import math_pool
from disa_jax.rewards import math_verify_grader as mvg

FIX = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "benchmarks"


@pytest.fixture(scope="module")
def pool():
  with math_pool.MathGraderPool(2) as p:
    yield p


# (response, ground truth, expected grade).
CASES = [
  ("\\boxed{25}", "025", True),            # AIME zero padding, both directions
  ("\\boxed{025}", "25", True),
  ("\\boxed{24}", "025", False),
  ("\\boxed{27}", "27.0", True),           # AMC float answers
  ("\\boxed{27.5}", "27.0", False),
  ("\\boxed{336}", "336^\\circ", True),    # Skywork AIME25 item 20
  ("\\boxed{336^\\circ}", "336", True),
  ("\\boxed{1.5e3}", "1500", True),        # scientific notation, both forms
  ("\\boxed{1500}", "1.5e3", True),
  ("\\boxed{1.5 \\times 10^{3}}", "1500", True),
  ("\\boxed{1.6e3}", "1500", False),
  ("\\boxed{2e3}", "16.30969097", False),  # raw LaTeX reads 2e3 as 2*e*3
  ("\\boxed{3 \\times 10^{8} \\mathrm{m/s}}", "3e8", True),
  ("\\boxed{10 \\text{ cm}}", "10", True),  # units
  ("\\boxed{12 \\text{ square units}}", "12", True),
  ("\\boxed{13 \\text{ cm}}", "12", False),
  ("\\boxed{50\\%}", "50", True),
  ("\\boxed{\\$ 5}", "5", True),
  ("\\boxed{3}", ["2", "3"], True),        # several acceptable answers
  ("\\boxed{4}", ["2", "3"], False),
  ("\\boxed{\\frac{1}{2}}", ["$0.5$"], True),  # OlympiadBench final_answer style
  ("The final answer is $\\frac{3}{4}$. I hope it is correct.", "0.75", True),  # Minerva style
  ("**Answer:** 7", "7", True),
  ("I give up.", "7", False),
  ("\\boxed{x=5}", "5", True),
  ("\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}", "\\left( 3, \\frac{\\pi}{2} \\right)", True),
  ("\\boxed{(3, \\pi)}", "\\left( 3, \\frac{\\pi}{2} \\right)", False),
]


@pytest.mark.parametrize("response,gt,expected", CASES)
def test_grade_cases(response, gt, expected):
  assert mvg.grade(response, gt) is expected


def test_gain_over_raw_math_verify_without_new_false_positives():
  gained = 0
  for response, gt, expected in CASES:
    if not isinstance(gt, str):
      continue
    ours, raw = mvg.grade(response, gt), mvg.grade_raw(response, gt)
    if ours and not raw:
      gained += 1
    assert ours is expected  # ours never accepts a wrong answer in the table
  assert gained >= 2  # e-notation answers are missed by raw math-verify


def _mutate(answer: str) -> str | None:
  m = re.search(r"\d", answer)
  if not m:
    return None
  return answer[:m.start()] + str((int(m.group()) + 1) % 10) + answer[m.end():]


def test_math500_fixture_references_pass_and_mutations_fail():
  rows = [json.loads(l) for l in (FIX / "math500_simplerl_sample.jsonl").read_text().splitlines()]
  for row in rows:
    assert mvg.grade(row["solution"], row["answer"]), row["unique_id"]
    mutated = _mutate(row["answer"])
    if mutated is not None:
      assert not mvg.grade(f"so \\boxed{{{mutated}}}", row["answer"]), (row["answer"], mutated)
  # Another problem's reference solution is wrong for this one (when the answers differ).
  for i, row in enumerate(rows):
    other = rows[(i + 5) % len(rows)]
    if other["answer"].strip() != row["answer"].strip():
      assert not mvg.grade(other["solution"], row["answer"])


def test_real_benchmark_formats_grade_their_own_answers():
  for name in ("aime24_qwen25math_sample.jsonl", "aime25_skywork_or1_sample.parquet",
               "amc23_qwen25math_sample.jsonl", "amc_2022_2023_rllm_sample.json"):
    for rec in load_prompts(str(FIX / name)):
      gt = rec.ground_truth
      # Models write the plain number: 25 for "025", 27 for "27.0", 336 for "336^\circ".
      plain = re.sub(r"\^\\circ|\.0$", "", gt).lstrip("0") or "0"
      assert mvg.grade(f"The answer is \\boxed{{{plain}}}.", gt), (name, gt)
      assert not mvg.grade(f"\\boxed{{{int(float(plain)) + 1}}}", gt), (name, gt)


def test_pool_grades_and_matches_in_process(pool):
  responses = [c[0] for c in CASES]
  gts = [c[1] for c in CASES]
  out = pool.grade(responses, gts, timeout_s=10.0)
  assert out.dtype == np.float32 and out.shape == (len(CASES),)
  np.testing.assert_array_equal(out, [float(c[2]) for c in CASES])


def test_pool_bounds_pathological_inputs_and_keeps_working(pool):
  killed0 = pool.num_killed
  bad = [
    "\\boxed{9^{9^{9^{9}}}}",
    "\\boxed{" + "\\frac{1}{" * 300 + "2" + "}" * 300 + "}",
    "x" * 1_000_000 + "\\boxed{2}",          # 1 MB response with a correct answer at the end
    "\\boxed{" + "1" * 1_000_000 + "}",       # 1 MB answer
  ]
  t0 = time.perf_counter()
  out = pool.grade(bad + ["\\boxed{2}"], ["5", "3", "2", "2", "2"], timeout_s=2.0)
  elapsed = time.perf_counter() - t0
  np.testing.assert_array_equal(out, [0.0, 0.0, 1.0, 0.0, 1.0])
  assert pool.num_killed >= killed0 + 1  # the tower of powers overran and was killed
  # 2 workers, 5 items, each bounded by 2 s: generous wall bound incl. one worker restart.
  assert elapsed < 30.0
  # The pool keeps grading correctly after the kill.
  np.testing.assert_array_equal(pool.grade(["\\boxed{4}", "\\boxed{5}"], ["4", "4"]), [1.0, 0.0])


def test_pool_replaces_a_worker_that_died(pool):
  pool.grade(["\\boxed{1}"], ["1"])
  victim = pool._workers[0].proc  # pylint: disable=protected-access
  victim.kill()
  victim.join()
  out = pool.grade(["\\boxed{1}", "\\boxed{2}", "\\boxed{3}", "\\boxed{4}"], ["1", "2", "0", "4"])
  np.testing.assert_array_equal(out, [1.0, 1.0, 0.0, 1.0])
  assert all(w.proc.is_alive() for w in pool._workers)  # pylint: disable=protected-access


def _crash_at_start(conn):
  del conn
  os._exit(3)


def test_pool_reports_workers_that_cannot_start(monkeypatch):
  monkeypatch.setattr(math_pool, "_worker_main", _crash_at_start)
  p = math_pool.MathGraderPool(1)
  try:
    with pytest.raises(RuntimeError, match="died before it was ready 3 times"):
      p.grade(["\\boxed{1}"], ["1"])
  finally:
    p.close()


def test_pool_input_validation(pool):
  with pytest.raises(ValueError, match="differ in length"):
    pool.grade(["a"], ["1", "2"])
  with pytest.raises(ValueError, match=r"responses\[0\] must be str"):
    pool.grade([3], ["3"])
  with pytest.raises(ValueError, match="timeout_s"):
    pool.grade(["a"], ["1"], timeout_s=0)
  with pytest.raises(ValueError, match="workers"):
    math_pool.MathGraderPool(0)


def test_public_api_and_registry():
  assert rewards.math_reward("so \\boxed{42}", "42") == 1.0
  assert rewards.math_reward("so \\boxed{41}", "42") == 0.0
  out = rewards.math_rewards(["\\boxed{1}", "\\boxed{2}"], ["1", "1"], workers=2)
  np.testing.assert_array_equal(out, [1.0, 0.0])
  fn = rewards.get_reward_fn("math")
  out = fn(["\\boxed{3}", "\\boxed{0.5}", "none"],
           [{"ground_truth": "3"}, {"ground_truth": ["1/2"]}, {"ground_truth": "1"}])
  assert isinstance(out, rewards.Graded) and out.reward.dtype == np.float32
  np.testing.assert_array_equal(out.reward, [1.0, 1.0, 0.0])
  assert not out.error.any()
  with pytest.raises(ValueError, match="ground_truth"):
    fn(["x"], [{"answer": "1"}])
  with pytest.raises(KeyError, match="registered"):
    rewards.get_reward_fn("nope")


def test_register_custom_reward():
  name = "length_test_reward"
  rewards.register_reward(name, lambda rs, ms: [float(len(r.text)) for r in rs], overwrite=True)
  np.testing.assert_array_equal(rewards.get_reward_fn(name)(["ab", ""], [{}, {}]).reward, [2.0, 0.0])
  with pytest.raises(ValueError, match="already registered"):
    rewards.register_reward(name, lambda rs, ms: rs)
  rewards.register_reward("bad_shape_test_reward", lambda rs, ms: [1.0], overwrite=True)
  with pytest.raises(ValueError, match="shape"):
    rewards.get_reward_fn("bad_shape_test_reward")(["a", "b"], [{}, {}])
  # A NaN or inf reward is refused, naming the reward and the index (it would enter the loss).
  rewards.register_reward("nan_test_reward", lambda rs, ms: [1.0, float("nan")], overwrite=True)
  with pytest.raises(ValueError, match=r"'nan_test_reward' returned 1 non-finite .* \[1\]"):
    rewards.get_reward_fn("nan_test_reward")(["a", "b"], [{}, {}])
  with pytest.raises(ValueError, match=r"responses\[1\] must be a Response or a str, got NoneType"):
    rewards.get_reward_fn(name)(["a", None], [{}, {}])
