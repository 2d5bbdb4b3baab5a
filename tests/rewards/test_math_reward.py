"""Math reward: math-verify grading with normalisations, and the time-bounded worker pool."""

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time
import warnings

import numpy as np
import pytest

from disa_jax import preemption, rewards
from disa_jax.rewards import math_pool
from disa_jax.rewards import math_verify_grader as mvg
from disa_jax.tasks.prompts import load_prompts

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
  with pytest.warns(rewards.GraderErrorWarning, match="item 0: timed out after 2.0 s"):
    graded = pool.grade(bad + ["\\boxed{2}"], ["5", "3", "2", "2", "2"], timeout_s=2.0,
                        return_errors=True)
  elapsed = time.perf_counter() - t0
  np.testing.assert_array_equal(graded.reward, [0.0, 0.0, 1.0, 0.0, 1.0])
  assert graded.error[0] and not graded.error[4]  # the tower overran: a grader error, not wrong
  assert pool.num_killed >= killed0 + 1  # the tower of powers overran and was killed
  # 2 workers, 5 items, each bounded by 2 s: generous wall bound incl. one worker restart.
  assert elapsed < 30.0
  # The pool keeps grading correctly after the kill.
  np.testing.assert_array_equal(pool.grade(["\\boxed{4}", "\\boxed{5}"], ["4", "4"]), [1.0, 0.0])


def test_pool_replaces_a_worker_that_died(pool):
  pool.grade(["\\boxed{1}"], ["1"])
  victim = pool._workers[0].proc  # pylint: disable=protected-access
  victim.kill()
  victim.wait()
  out = pool.grade(["\\boxed{1}", "\\boxed{2}", "\\boxed{3}", "\\boxed{4}"], ["1", "2", "0", "4"],
                   return_errors=True)
  np.testing.assert_array_equal(out.reward, [1.0, 1.0, 0.0, 1.0])
  assert not out.error.any()  # the dead idle worker was replaced before it got an item
  assert all(w.alive() for w in pool._workers)  # pylint: disable=protected-access


def test_pool_reports_workers_that_cannot_start():
  p = math_pool.MathGraderPool(1, grader="tests.rewards.grader_hooks:die_at_start")
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


# ------------------------------------------------------------------------------------------------
# Grader errors are counted apart from wrong answers (issue 17, item 3).
# ------------------------------------------------------------------------------------------------

HOOKS = "tests.rewards.grader_hooks"


def test_grader_exceptions_are_marked_and_warned():
  with math_pool.MathGraderPool(1, grader=f"{HOOKS}:grade_or_raise") as p:
    responses = ["\\boxed{1}", "RAISE \\boxed{2}", "\\boxed{3}"]
    with pytest.warns(rewards.GraderErrorWarning,
                      match=r"math grading: 1 of 3 items \(33\.3%\) raised or timed out .*"
                            r"item 1: ValueError: injected grader failure"):
      out = p.grade(responses, ["1", "2", "4"], return_errors=True)
    assert isinstance(out, rewards.Graded)
    assert out.reward.dtype == np.float32 and out.error.dtype == bool
    np.testing.assert_array_equal(out.reward, [1.0, 0.0, 0.0])
    np.testing.assert_array_equal(out.error, [False, True, False])  # item 2 is wrong, not an error
    assert out.num_errors == 1 and out.error_share == pytest.approx(1 / 3)
    with pytest.warns(rewards.GraderErrorWarning):  # the old call: rewards only, still warns
      plain = p.grade(responses, ["1", "2", "4"])
    assert isinstance(plain, np.ndarray)
    np.testing.assert_array_equal(plain, [1.0, 0.0, 0.0])


def test_grader_timeouts_and_dead_workers_are_errors():
  with math_pool.MathGraderPool(2, grader=f"{HOOKS}:grade_or_die") as p:
    responses = ["\\boxed{9^{9^{9^{9}}}}", "DIE", "\\boxed{4}", "\\boxed{5}"]
    with pytest.warns(rewards.GraderErrorWarning, match=r"2 of 4 items \(50\.0%\)") as rec:
      out = p.grade(responses, ["5", "1", "4", "4"], timeout_s=2.0, return_errors=True)
    np.testing.assert_array_equal(out.reward, [0.0, 0.0, 1.0, 0.0])
    np.testing.assert_array_equal(out.error, [True, True, False, False])
    text = str(rec[0].message)
    assert "item 0: timed out after 2.0 s" in text and "the grading worker died" in text
    assert p.num_killed == 1


def test_error_share_at_or_below_the_threshold_is_quiet():
  n = 40  # 2 errors of 40 = 5.0%: not above ERROR_SHARE_WARN
  responses = ["RAISE" if i < 2 else f"\\boxed{{{i}}}" for i in range(n)]
  with warnings.catch_warnings():
    warnings.simplefilter("error", rewards.GraderErrorWarning)
    out = math_pool.math_rewards(responses, [str(i) for i in range(n)], return_errors=True,
                                 grader=f"{HOOKS}:grade_or_raise")
  assert math_pool.ERROR_SHARE_WARN == 0.05
  assert out.num_errors == 2 and out.reward.sum() == n - 2
  with pytest.warns(rewards.GraderErrorWarning, match=r"3 of 40 items \(7\.5%\)"):
    math_pool.math_rewards(["RAISE"] * 3 + responses[3:], [str(i) for i in range(n)],
                           grader=f"{HOOKS}:grade_or_raise")


# ------------------------------------------------------------------------------------------------
# No `__main__` guard needed (issue 17, item 2).
# ------------------------------------------------------------------------------------------------

ROOT = pathlib.Path(__file__).resolve().parents[2]
UNGUARDED = ("from disa_jax.rewards import math_reward, math_rewards\n"
             "print('REWARD', math_reward('so \\\\boxed{42}', '42'), math_reward('\\\\boxed{41}', '42'))\n"
             "print('BATCH', math_rewards(['\\\\boxed{1}', 'x'], ['1', '1'], workers=2).tolist())\n")


@pytest.mark.parametrize("how", ["file", "stdin"])
def test_math_reward_from_an_unguarded_script(tmp_path, how):
  """A plain script (no `if __name__ == '__main__':`) and piped code (as a notebook runs it)."""
  script = tmp_path / "plain_script.py"
  script.write_text(UNGUARDED)
  env = dict(os.environ, PYTHONPATH=str(ROOT))
  cmd = [sys.executable, str(script)] if how == "file" else [sys.executable, "-"]
  out = subprocess.run(cmd, input=UNGUARDED if how == "stdin" else None, cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  assert out.stdout.splitlines() == ["REWARD 1.0 0.0", "BATCH [1.0, 0.0]"], out.stdout
  assert "bootstrapping" not in out.stderr, out.stderr[-3000:]


def test_workers_survive_a_sigterm_while_they_start(monkeypatch):
  """SIGTERM to each worker as soon as it exists (its interpreter still starting) and to this
  process, as SLURM signals a job step: the stage saves and closes the pool itself, so no worker
  may die of it (a dead worker would be replaced: other pids)."""
  init = math_pool._Worker.__init__  # pylint: disable=protected-access

  def signalled(self, grader):
    init(self, grader)
    os.kill(self.proc.pid, signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGTERM)

  monkeypatch.setattr(math_pool._Worker, "__init__", signalled)  # pylint: disable=protected-access
  with preemption.watch():
    with math_pool.MathGraderPool(2) as p:
      pids = [w.proc.pid for w in p._workers]  # pylint: disable=protected-access
      assert list(p.grade(["\\boxed{2}", "\\boxed{3}"], ["2", "2"])) == [1.0, 0.0]
      assert [w.proc.pid for w in p._workers] == pids  # pylint: disable=protected-access
      assert all(w.alive() for w in p._workers)  # pylint: disable=protected-access
    assert preemption.requested() == "SIGTERM"
