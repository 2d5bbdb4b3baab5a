"""The prompt formats (veRL and the math and code tasks' benchmark formats), prompt records and
templates."""

import json
import pathlib

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from disa_jax import data
from disa_jax.data import templates
from disa_jax.data.rows import read_rows
from disa_jax.tasks import code as code_task
from disa_jax.tasks import math as math_task
from disa_jax.tasks import prompts
from disa_jax.tasks.prompts import load_prompts

FIX = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "benchmarks"


@pytest.mark.parametrize("name,n,first_gt,source", [
  ("math500_simplerl_sample.jsonl", 42, "\\left( 3, \\frac{\\pi}{2} \\right)",
   "math500_simplerl_sample"),
  ("aime24_qwen25math_sample.jsonl", 10, "204", "aime24_qwen25math_sample"),
  ("aime24_rllm_sample.json", 5, "204", "aime24_rllm_sample"),
  ("aime25_areal_sample.jsonl", 5, "70", "aime25_areal_sample"),
  ("aime25_skywork_or1_sample.parquet", 5, "70", "test-math-aime25"),
  ("amc23_qwen25math_sample.jsonl", 5, "27.0", "amc23_qwen25math_sample"),
  ("amc_2022_2023_rllm_sample.json", 5, "142.0", "amc_2022_2023_rllm_sample"),
])
def test_real_math_files(name, n, first_gt, source):
  recs = load_prompts(str(FIX / name))
  assert len(recs) == n
  r = recs[0]
  assert r.ground_truth == first_gt
  assert r.data_source == source
  assert r.ability == "math"
  assert r.reward_meta() == {"ground_truth": first_gt}
  assert len({x.prompt_id for x in recs}) == n
  assert isinstance(r.prompt, list) and r.prompt[-1]["role"] == "user"
  if name.endswith(".parquet"):  # veRL rows keep their own prompt
    assert r.prompt_text().startswith("Find the sum of all integer bases")
  else:
    assert r.prompt_text().endswith(math_task.MATH_INSTRUCTION)
    assert r.extra["problem"] in r.prompt_text()


def test_zero_padded_aime_answers_are_kept_verbatim():
  gts = [r.ground_truth for r in load_prompts(str(FIX / "aime24_qwen25math_sample.jsonl"))]
  assert "025" in gts  # graded as numbers by the math reward, not rewritten by the loader


def test_skywork_item_20_ground_truth():
  gts = [r.ground_truth for r in load_prompts(str(FIX / "aime25_skywork_or1_sample.parquet"))]
  assert "336^\\circ" in gts


def test_humanevalplus_file():
  recs = load_prompts(str(FIX / "humanevalplus_sample.jsonl.gz"))
  assert [r.prompt_id for r in recs] == ["HumanEval/0", "HumanEval/2", "HumanEval/32",
                                        "HumanEval/55"]
  r = recs[0]
  assert r.ability == "code"
  assert r.reward_meta()["humaneval"]["entry_point"] == "has_close_elements"
  assert "```python" in r.prompt_text() and "def has_close_elements" in r.prompt_text()


def _write_jsonl(path, rows):
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return str(path)


def test_minerva_made_up_records(tmp_path):
  rows = [{"problem": "Compute 2+2.", "solution": "It is $\\boxed{4}$.", "type": "Astro", "idx": 0},
          {"problem": "Mass?", "solution": "So \\boxed{3 \\times 10^{5}}", "idx": 1,
           "answer": "3e5"}]
  recs = load_prompts(_write_jsonl(tmp_path / "minerva_math.jsonl", rows))
  assert [r.ground_truth for r in recs] == ["4", "3e5"]
  assert recs[0].prompt_id == "minerva_math/0"
  bad = [{"problem": "x", "solution": "no box", "type": "t"}]
  with pytest.raises(ValueError, match="no answer field"):
    load_prompts(_write_jsonl(tmp_path / "minerva_bad.jsonl", bad), fmt="minerva")


def test_olympiadbench_made_up_records(tmp_path):
  rows = [{"id": 2231, "question": "Find x.", "final_answer": ["$\\frac{1}{2}$"],
           "context": None, "unit": None, "error": None, "is_multiple_answer": False,
           "answer_type": "Numerical"},
          {"id": 2232, "question": "Find speed.", "final_answer": ["$3$", "$3.0$"],
           "context": "A car moves.", "unit": "m/s", "error": "1e-2", "is_multiple_answer": False,
           "answer_type": "Numerical"}]
  recs = load_prompts(_write_jsonl(tmp_path / "OE_TO_maths_en_COMP.jsonl", rows))
  assert recs[0].ground_truth == ["\\frac{1}{2}"]
  assert recs[1].ground_truth == ["3", "3.0"]
  assert recs[1].extra["unit"] == "m/s" and recs[1].extra["error"] == "1e-2"
  assert "A car moves." in recs[1].prompt_text()
  assert recs[1].reward_meta() == {"ground_truth": ["3", "3.0"]}


def test_rllm_code_made_up_records(tmp_path):
  lcb = [{"problem": "Add two numbers.", "tests": json.dumps(
            [{"input": "1 2\n", "output": "3\n", "testtype": "stdin"}]),
          "starter_code": "", "metadata": {"question_id": "abc123"}}]
  cf = [{"problem": "Print n.", "tests": [{"input": "5", "output": "5"}]}]
  p1 = tmp_path / "livecodebench.json"
  p1.write_text(json.dumps(lcb))
  p2 = tmp_path / "codeforces.json"
  p2.write_text(json.dumps(cf))
  r1 = load_prompts(str(p1), fmt="livecodebench")[0]
  r2 = load_prompts(str(p2))[0]
  assert r1.prompt_id == "livecodebench/abc123"
  assert r1.ground_truth == [{"input": "1 2\n", "output": "3\n", "testtype": "stdin"}]
  assert r1.ability == "code" and r1.reward_meta() == {"tests": r1.ground_truth}
  assert code_task.CODE_STDIO_INSTRUCTION in r1.prompt_text()
  assert r2.ground_truth == [{"input": "5", "output": "5"}]
  fn = [{"problem": "Two sum.", "starter_code": "class Solution:\n    def twoSum(self, nums, t):",
         "tests": [{"input": "[2, 7]\n9", "output": "[0, 1]", "testtype": "functional"}],
         "metadata": json.dumps({"func_name": "twoSum"})}]
  p3 = tmp_path / "lcb_fn.json"
  p3.write_text(json.dumps(fn))
  r3 = load_prompts(str(p3))[0]
  assert r3.reward_meta() == {"tests": fn[0]["tests"], "func_name": "twoSum"}
  assert "class Solution" in r3.prompt_text()
  fn[0]["metadata"] = {}
  p3.write_text(json.dumps(fn))
  with pytest.raises(ValueError, match="func_name"):
    load_prompts(str(p3))
  mixed = [{"problem": "p", "tests": [{"input": "1", "output": "1", "testtype": "stdin"},
                                      {"input": "1", "output": "1", "testtype": "functional"}]}]
  p3.write_text(json.dumps(mixed))
  with pytest.raises(ValueError, match="all 'stdin' or all 'functional'"):
    load_prompts(str(p3))


def test_verl_parquet_and_jsonl_roundtrip(tmp_path):
  recs = [
    data.PromptRecord("dapo/0", [{"role": "user", "content": "What is 1+1?"}], "2", "dapo",
                      {"ability": "math", "index": 0}),
    data.PromptRecord("dapo/1", "Plain prompt", "3", "dapo", {"ability": "math", "index": 1}),
  ]
  for ext in ("jsonl", "parquet"):
    path = str(tmp_path / f"train.{ext}")
    data.save_prompts(recs, path)
    back = load_prompts(path)
    assert [r.prompt_id for r in back] == ["dapo/0", "dapo/1"]  # ids survive the round trip
    assert [r.ground_truth for r in back] == ["2", "3"]
    assert back[0].prompt == [{"role": "user", "content": "What is 1+1?"}]
    assert back[1].prompt == [{"role": "user", "content": "Plain prompt"}]
    assert all(r.data_source == "dapo" for r in back)


def test_verl_code_rows_with_json_ground_truth(tmp_path):
  tests = [{"input": "1", "output": "1"}]
  rows = [{"data_source": "deepcoder", "prompt": [{"role": "user", "content": "echo"}],
           "ability": "code", "reward_model": {"style": "rule", "ground_truth": json.dumps(tests)},
           "extra_info": {"index": 7}}]
  path = str(tmp_path / "code.parquet")
  pq.write_table(pa.Table.from_pylist(rows), path)
  r = load_prompts(path)[0]
  assert r.prompt_id == "deepcoder/7" and r.ground_truth == tests
  assert r.reward_meta() == {"tests": tests}
  data.save_prompts([r], str(tmp_path / "again.jsonl"))
  again = load_prompts(str(tmp_path / "again.jsonl"))[0]
  assert again.ground_truth == tests and again.prompt_id == "deepcoder/7"


def test_errors_name_the_field(tmp_path):
  with pytest.raises(ValueError, match="cannot detect"):
    load_prompts(_write_jsonl(tmp_path / "x.jsonl", [{"foo": 1}]))
  with pytest.raises(ValueError, match="fmt must be"):
    load_prompts(_write_jsonl(tmp_path / "y.jsonl", [{"foo": 1}]), fmt="nope")
  with pytest.raises(ValueError, match=r"y2\.jsonl: row 0: answer is missing or null"):
    load_prompts(_write_jsonl(tmp_path / "y2.jsonl", [{"problem": "p"}]), fmt="math")
  with pytest.raises(ValueError, match="duplicate prompt_id"):
    dup = [{"problem": "a", "answer": "1", "id": 1}, {"problem": "b", "answer": "2", "id": 1}]
    load_prompts(_write_jsonl(tmp_path / "z.jsonl", dup))
  with pytest.raises(ValueError, match="invalid JSON"):
    (tmp_path / "bad.jsonl").write_text("{not json}\n")
    load_prompts(str(tmp_path / "bad.jsonl"))
  with pytest.raises(ValueError, match="prompt_id"):
    data.PromptRecord("", "p", "1", "s")
  with pytest.raises(ValueError, match=r"prompt\[0\]"):
    data.PromptRecord("a", [{"content": "x"}], "1", "s")
  with pytest.raises(ValueError, match="unknown file type"):
    read_rows(str(tmp_path / "a.csv"))


def test_limit_and_benchmark_names():
  recs = load_prompts(str(FIX / "math500_simplerl_sample.jsonl"), fmt="math500", limit=3)
  assert len(recs) == 3
  assert set(prompts.benchmark_formats()) == {"aime24", "aime25", "amc23", "math500", "minerva",
                                         "olympiadbench", "humanevalplus", "livecodebench",
                                         "codeforces"}


def test_templates():
  assert math_task.math_prompt(" 1+1? ") == "1+1?\n\n" + math_task.MATH_INSTRUCTION
  assert "\\boxed{}" in math_task.MATH_INSTRUCTION
  assert "```python" in code_task.code_prompt("Sum.")
  starter = code_task.code_prompt("Sum.", "class Solution:\n    def f(self): ")
  assert "class Solution" in starter and code_task.CODE_FUNCTION_INSTRUCTION in starter
  with pytest.raises(ValueError, match="problem"):
    math_task.math_prompt("")
  msgs = templates.chat_messages("hi", system="sys")
  assert msgs == [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}]
  assert templates.render_chat(None, "plain") == "plain"


def test_render_chat_with_a_tokenizer_template():
  class Tok:
    def apply_chat_template(self, msgs, tokenize, add_generation_prompt):
      assert tokenize is False
      return "".join(f"<{m['role']}>{m['content']}" for m in msgs) + (
        "<assistant>" if add_generation_prompt else "")
  assert templates.render_chat(Tok(), templates.chat_messages("q")) == "<user>q<assistant>"
