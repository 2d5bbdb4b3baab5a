"""Code reward: stdio comparison, HumanEval+ function-call grading, value encoding, registry."""

import gzip
import json
import math
import pathlib
import random
import re
import time

import numpy as np
import pytest

from disa_jax.rewards import _humaneval_runner as runner
from disa_jax.rewards import code
from disa_jax.tasks import code as code_task

FIX = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "benchmarks"


@pytest.fixture(scope="module")
def he():
  with gzip.open(FIX / "humanevalplus_sample.jsonl.gz", "rt") as f:
    return {r["task_id"]: r for r in map(json.loads, f)}


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path_factory, monkeypatch):
  monkeypatch.setenv("DISA_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "disa_cache"))


@pytest.mark.parametrize("actual,expected,ok", [
  ("3\n", "3", True),
  ("3  \n\n\n", "3\n", True),
  ("1 2\r\n3\n", "1 2\n3", True),
  ("1  2\n3", "1 2\n3", True),           # token fallback
  ("0.3333333", "0.333333333", True),    # decimal tolerance 1e-6
  ("0.34", "0.333333333", False),
  ("3", "3.0000001", True),
  ("4", "3", False),
  ("3.0", "3", False),                   # integers are exact
  ("YES", "yes", False),
  ("", "0", False),
  ("nan", "0.5", False),
])
def test_stdio_output_matches(actual, expected, ok):
  assert code.stdio_output_matches(actual, expected) is ok


def test_extract_code():
  resp = "text\n```python\nprint(1)\n```\nmore\n```python\nprint(2)\n```\n"
  assert code.extract_code(resp) == "print(2)\n"
  assert code.extract_code("```\nx = 1\n```") == "x = 1\n"
  assert code.extract_code("```cpp\nint x;\n```\n```py\ny = 2\n```") == "y = 2\n"
  assert code.extract_code("print(3)") == "print(3)"


def test_run_stdio_per_case_results():
  prog = "a, b = map(int, input().split())\nprint(a + b if a < 100 else a - b)\n"
  cases = [{"input": "1 2\n", "output": "3\n"}, {"input": "100 1", "output": "101"},
           {"input": "5 5", "output": "10"}]
  assert code.run_stdio(prog, cases, 5.0) == [True, False, True]
  assert code.run_stdio("syntax error(", cases[:1], 5.0) == [False]
  assert code.run_stdio("print(3)", cases[:1], 5.0) == [True]  # the same case, a correct program
  assert code.run_stdio(prog, [], 5.0) == []
  with pytest.raises(ValueError, match=r"cases\[0\]"):
    code.run_stdio(prog, [{"input": "1"}], 5.0)


def test_run_functional_leetcode_style():
  prog = ("class Solution:\n"
          "    def twoSum(self, nums, target):\n"
          "        print('debug output is ignored')\n"
          "        seen = {}\n"
          "        for i, x in enumerate(nums):\n"
          "            if target - x in seen:\n"
          "                return [seen[target - x], i]\n"
          "            seen[x] = i\n")
  cases = [{"input": "[2, 7, 11, 15]\n9", "output": "[0, 1]"},
           {"input": "[3, 2, 4]\n6", "output": "[1, 2]"},
           {"input": "[3, 3]\n6", "output": "[1, 0]"}]
  assert code.run_functional(prog, cases, "twoSum", 5.0) == [True, True, False]
  top_level = "def add(a, b):\n    return (a + b, a - b)\n"
  assert code.run_functional(top_level, [{"input": "1\n2", "output": "[3, -1]"}], "add") == [True]
  with pytest.raises(ValueError, match="func_name"):
    code.run_functional(prog, cases, "not valid")
  fn = code_task.TASK.reward_fn()  # the registered reward (rewards.get_reward_fn("code"))
  tests = [dict(c, testtype="functional") for c in cases[:2]]
  out = fn(["```python\n" + prog + "```"] * 2,
           [{"tests": tests, "func_name": "twoSum"}, {"tests": tests, "func_name": "threeSum"}])
  np.testing.assert_array_equal(out.reward, [1.0, 0.0])


@pytest.mark.parametrize("value", [
  None, True, 3, -2**70, 10**400, 1.5, float("inf"), -float("inf"), "s", [1, [2.5, "x"]],
  (1, 2), (), {1, 2}, frozenset({"a"}), {"a": 1, 2: (3,)}, b"\x00\xff", 1 + 2j, [(1, 2), [3]],
])
def test_value_encoding_roundtrip(value):
  enc = json.loads(json.dumps(runner.encode(value)))
  dec = code.decode_value(enc)
  assert dec == value and type(dec) is type(value)


def test_value_encoding_nan_and_repr():
  dec = code.decode_value(json.loads(json.dumps(runner.encode(float("nan")))))
  assert math.isnan(dec)
  obj = code.decode_value(json.loads(json.dumps(runner.encode(object))))
  assert obj[0] == "__repr__"
  with pytest.raises(ValueError, match="unknown tag"):
    code.decode_value({"__t": "pickle", "v": ""})


@pytest.mark.parametrize("out,exp,atol,ok", [
  (1.0, 1.0, 0, True),
  (1.0 + 1e-9, 1.0, 0, True),            # floats get atol 1e-6 even when atol is 0
  (1.1, 1.0, 0, False),
  ([1.0, 2.0000001], [1.0, 2.0], 0, True),
  ((1.0, 2.0), [1.0, 2.0], 1e-6, False),  # type must match
  ([1.0], [1.0, 2.0], 1e-6, False),
  (3, 3, 0, True),
  (True, 1, 0, True),                    # Python equality, as in EvalPlus
  ("a", "b", 0, False),
])
def test_humaneval_outputs_match(out, exp, atol, ok):
  assert code.humaneval_outputs_match(out, exp, atol) is ok


def test_find_zero_oracle():
  assert code.humaneval_outputs_match(-0.5, 99.0, 1e-4, entry_point="find_zero", args=[[1, 2]])
  assert not code.humaneval_outputs_match(0.5, -0.5, 1e-4, entry_point="find_zero",
                                          args=[[1, 2]])


def test_canonical_solutions_pass(he):
  for task_id, prob in he.items():
    assert code.run_humaneval(prob, prob["canonical_solution"]), task_id


def test_full_function_completion_and_alternative_correct_solutions(he):
  fib = he["HumanEval/55"]
  iterative = ("def fib(n: int):\n"
               "    a, b = 0, 1\n"
               "    for _ in range(n):\n"
               "        a, b = b, a + b\n"
               "    return a\n")
  assert code.run_humaneval(fib, iterative)
  # A root finder whose outputs differ from the canonical ones (two extra Newton steps) passes
  # find_zero through its oracle |poly(xs, x)| <= atol, not by equality.
  refined = ("def find_zero(xs):\n"
             "    dxs = [xs[i] * i for i in range(1, len(xs))]\n"
             "    x = 0.0\n"
             "    for _ in range(1000):\n"
             "        fx = poly(xs, x)\n"
             "        if abs(fx) < 1e-5:\n"
             "            break\n"
             "        x = x - fx / poly(dxs, x)\n"
             "    for _ in range(2):\n"
             "        d = poly(dxs, x)\n"
             "        if d != 0 and abs(poly(xs, x - poly(xs, x) / d)) <= abs(poly(xs, x)):\n"
             "            x = x - poly(xs, x) / d\n"
             "    return x\n")
  assert code.run_humaneval(he["HumanEval/32"], refined)


@pytest.mark.parametrize("task_id,completion", [
  ("HumanEval/55", "    return n\n"),
  ("HumanEval/55", ("def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n"
                    "        a, b = b, a + b\n    return a + (n == 10)\n")),  # wrong on one input
  ("HumanEval/2", "    return number - int(number) + 1e-3\n"),      # outside atol
  ("HumanEval/2", "    return round(number % 1.0, 2)\n"),
  ("HumanEval/0", "    return False\n"),
  ("HumanEval/0", ("    for i, a in enumerate(numbers):\n        for b in numbers[i + 1:]:\n"
                   "            if abs(a - b) <= threshold:\n                return True\n"
                   "    return False\n")),                           # <= instead of <
  ("HumanEval/32", "    return 0.0\n"),
  ("HumanEval/55", "    import os\n    os._exit(0)\n"),                # exits early
  ("HumanEval/55", "    while True:\n        pass\n"),                 # never returns
  ("HumanEval/55", "def check(candidate):\n    pass\ndef fib(n):\n    return 0\n"),  # fake check
  ("HumanEval/55", "    print('noise' * 1000)\n    return 1\n"),
  ("HumanEval/55", "syntax error("),
])
def test_wrong_solutions_fail(he, task_id, completion):
  assert not code.run_humaneval(he[task_id], completion, timeout_s=2.0)
  # Positive control in the same configuration: the canonical solution passes.
  assert _canonical_passes(he, task_id, 2.0)


_CANONICAL: dict[tuple[str, float], bool] = {}


def _canonical_passes(he, task_id, timeout_s):
  """Whether the canonical solution of `task_id` passes with `timeout_s` (once per session)."""
  key = (task_id, timeout_s)
  if key not in _CANONICAL:
    _CANONICAL[key] = code.run_humaneval(he[task_id], he[task_id]["canonical_solution"],
                                         timeout_s=timeout_s)
  return _CANONICAL[key]


def test_expected_outputs_cached_on_disk(he, tmp_path, monkeypatch):
  monkeypatch.setenv("DISA_CACHE_DIR", str(tmp_path))
  code._EXPECTED_MEM.clear()  # pylint: disable=protected-access
  prob = he["HumanEval/55"]
  first = code.humaneval_expected_outputs(prob)
  files = list((tmp_path / "humaneval_expected").glob("*.json"))
  assert len(files) == 1
  assert len(first) == len(prob["base_input"]) + len(prob["plus_input"])
  code._EXPECTED_MEM.clear()  # pylint: disable=protected-access
  assert code.humaneval_expected_outputs(prob) == first


def test_code_registry(he):
  fn = code_task.TASK.reward_fn()  # the registered reward (rewards.get_reward_fn("code"))
  responses = ["```python\na, b = map(int, input().split())\nprint(a * b)\n```",
               "```python\nprint(0)\n```",
               ("```python\n" + he["HumanEval/55"]["prompt"] +
                he["HumanEval/55"]["canonical_solution"] + "```"),
               "no code"]
  metas = [{"tests": [{"input": "2 3", "output": "6"}, {"input": "4 5", "output": "20"}]},
           {"tests": [{"input": "2 3", "output": "6"}]},
           {"humaneval": he["HumanEval/55"]},
           {"tests": [{"input": "", "output": "1"}]}]
  out = fn(responses, metas)
  assert out.reward.dtype == np.float32
  np.testing.assert_array_equal(out.reward, [1.0, 0.0, 1.0, 0.0])
  with pytest.raises(ValueError, match="'tests' or 'humaneval'"):
    fn(["x"], [{"ground_truth": "1"}])


# The fence regular expression extract_code used to run (quadratic on a long fence line without a
# newline); its blocks are the definition the linear scanner must reproduce.
_FENCE_RE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)


def test_extract_code_blocks_are_the_fence_regex_blocks():
  frags = ["```", "```python\n", "```py\n", "``` python extra\n", "\n", "x = 1\n", "`", "``",
           "````", " ", "```\n", "abc", "\t```c++ \n"]
  rng = random.Random(0)
  for _ in range(20_000):
    text = "".join(rng.choice(frags) for _ in range(rng.randint(1, 7)))
    blocks = code._fenced_blocks(text)  # pylint: disable=protected-access
    assert blocks == _FENCE_RE.findall(text), text


@pytest.mark.parametrize("make", [lambda n: "`" * n, lambda n: "```" + "a" * n,
                                  lambda n: "```\n" + "`` " * (n // 3)])
def test_extract_code_time_is_linear(make):
  """Issue 24, finding 4 (the code reward's parse in the grader): 100x the length, <= 300x time."""
  def cpu(text, repeats):
    best = float("inf")
    for _ in range(repeats):
      t0 = time.thread_time()
      code.extract_code(text)
      best = min(best, time.thread_time() - t0)
    return max(best, 1e-6)
  ratio = cpu(make(100_000), 3) / cpu(make(1_000), 30)
  assert ratio <= 300, ratio
