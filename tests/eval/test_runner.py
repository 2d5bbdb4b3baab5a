"""Benchmark runner with a scripted engine: prompts -> completions -> rewards -> metrics."""

import time

import numpy as np
import pytest

from disa_jax import testing
from disa_jax.data import PromptRecord
from disa_jax.data import templates
from disa_jax.eval import runner
from disa_jax.rewards import registry
from disa_jax.rollout.types import Completion
from disa_jax.tasks.code import code_prompt
from disa_jax.tasks.math import math_prompt


class ScriptedEngine:
  """Returns fixed response texts per prompt (looked up by the decoded prompt)."""

  def __init__(self, tok, script):
    self.tok, self.script, self.calls = tok, script, []

  def generate(self, prompt_token_ids, params):
    self.calls.append(params)
    out = []
    for ids in prompt_token_ids:
      text = self.tok.decode(ids)
      key = next(k for k in self.script if k in text)
      row = []
      for resp in self.script[key][:params.n]:
        tids = self.tok(resp, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
        row.append(Completion(np.asarray(tids), np.zeros(len(tids)), None, "stop"))
      out.append(row)
    return out


def _math_records():
  return [PromptRecord("p0", templates.chat_messages(math_prompt("What is 1+1?")), "2",
                       "toy", {"ability": "math"}),
          PromptRecord("p1", templates.chat_messages(math_prompt("What is 2+3?")), "5",
                       "toy", {"ability": "math"})]


def test_math_benchmark_metrics():
  tok = testing.make_tokenizer()
  engine = ScriptedEngine(tok, {
    "1+1": ["so \\boxed{2}", "\\boxed{3}", "\\boxed{2}", "hmm"],
    "2+3": ["\\boxed{6}", "\\boxed{6}", "\\boxed{5}", "\\boxed{6}"],
  })
  params = runner.eval_sampling_params(4, 64, tok.eos_token_id)
  assert (params.temperature, params.top_p, params.n) == (0.6, 0.95, 4)
  res = runner.evaluate_benchmark(engine, tok, _math_records(), params, name="toy")
  np.testing.assert_array_equal(res.correct, [[1, 0, 1, 0], [0, 0, 1, 0]])
  assert res.metrics["mean@4"] == pytest.approx(3 / 8)
  assert res.metrics["pass@1"] == pytest.approx(3 / 8)
  assert res.metrics["pass@4"] == pytest.approx(1.0)
  assert res.metrics["maj@4"] == pytest.approx(0.5)  # p0 majority "2" right, p1 majority "6" wrong
  assert res.answers[1] == ["6", "6", "5", "6"]
  assert res.responses[0][0] == "so \\boxed{2}"
  assert res.metrics["distinct_correct@4"] == pytest.approx((2 + 1) / 2)  # p0: "so \boxed{2}", "\boxed{2}"
  table = runner.suite_table({"base": {"toy": res}}, "mean@4")
  assert "| base | 37.5 | 37.5 |" in table
  with pytest.raises(KeyError, match="no metric"):
    runner.suite_table({"base": {"toy": res}}, "mean@8")


def test_code_benchmark_and_suite(tmp_path):
  tok = testing.make_tokenizer()
  recs = [PromptRecord("c0", templates.chat_messages(code_prompt("Double n.")),
                       [{"input": "3", "output": "6"}, {"input": "5", "output": "10"}], "toy",
                       {"ability": "code"})]
  good = "```python\nprint(int(input()) * 2)\n```"
  bad = "```python\nprint(6)\n```"
  engine = ScriptedEngine(tok, {"Double": [good, bad, bad, good]})
  params = runner.eval_sampling_params(4, 64, tok.eos_token_id)
  out = runner.evaluate_suite(engine, tok, {"code": recs}, params, pass_ks=(1, 2, 4))
  res = out["code"]
  np.testing.assert_array_equal(res.correct, [[1, 0, 0, 1]])
  assert res.metrics == {"pass@1": pytest.approx(0.5), "pass@2": pytest.approx(1 - 1 / 6),
                         "pass@4": pytest.approx(1.0), "distinct_correct@4": 1.0,
                         "grade_error_share": 0.0}  # the two correct responses are the same text
  runner.suite_table({"m": out}, "pass@1", json_path=str(tmp_path / "r.json"),
                     md_path=str(tmp_path / "r.md"))
  assert (tmp_path / "r.md").read_text().startswith("| Method | code | Average |")


def test_runner_validation():
  tok = testing.make_tokenizer()
  params = runner.eval_sampling_params(2, 8, None)
  with pytest.raises(ValueError, match="no records"):
    runner.evaluate_benchmark(None, tok, [], params)
  mixed = _math_records()[:1] + [PromptRecord("c", "x", [{"input": "", "output": ""}], "t",
                                              {"ability": "code"})]
  with pytest.raises(ValueError, match="mix abilities"):
    runner.evaluate_benchmark(None, tok, mixed, params)


# Model outputs that took the old answer extraction quadratic time (10^5 newlines without an
# answer: minutes), and two with an answer after the same shapes.
PATHOLOGICAL = ["\n" * 100_000, "Answer" + "\n" * 100_000, "\\boxed \n" * 12_500 + "Answer: 3",
                "\n" * 100_000 + "Answer: 2"]


def test_pathological_outputs_do_not_stall_maj_at_k():
  """Issue 24, finding 4: maj@k parses every response in this process; it stays linear-time."""
  registry.register_reward("test_zero", lambda rs, ms: np.zeros(len(rs), np.float32),
                           overwrite=True)  # grading is bounded elsewhere; time the parse only
  tok = testing.make_tokenizer()
  engine = ScriptedEngine(tok, {"1+1": PATHOLOGICAL, "2+3": PATHOLOGICAL})
  params = runner.eval_sampling_params(4, 64, tok.eos_token_id)
  t0 = time.perf_counter()
  res = runner.evaluate_benchmark(engine, tok, _math_records(), params, name="toy",
                                  reward_fn_name="test_zero")
  assert time.perf_counter() - t0 < 20.0
  assert res.answers == [[None, None, "3", "2"]] * 2
