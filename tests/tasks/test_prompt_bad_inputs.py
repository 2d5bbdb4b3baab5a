"""Malformed prompt files and rows: every loader format refuses them with an error naming the file,
the row, the field and the value, and nothing None (or the text 'None') reaches grading or prompting.

Each case writes a made-up one-row file (jsonl, and parquet through pyarrow where the loader reads
parquet), next to the same row without the defect, which must load: so a broken writer cannot make
a case pass.
"""

import copy
import gzip
import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from disa_jax import data
from disa_jax.tasks.prompts import formats, load_prompts

VERL = {"data_source": "dapo", "prompt": [{"role": "user", "content": "What is 1+1?"}],
        "ability": "math", "reward_model": {"style": "rule", "ground_truth": "2"},
        "extra_info": {"index": 0}}
VERL_CODE = {"data_source": "deepcoder", "prompt": [{"role": "user", "content": "Echo."}],
             "ability": "code",
             "reward_model": {"style": "rule",
                              "ground_truth": json.dumps([{"input": "1", "output": "1"}])},
             "extra_info": {"index": 0}}
MATH = {"problem": "What is 1+1?", "answer": "2", "unique_id": "u0"}
MINERVA = {"problem": "Compute 2+2.", "solution": "It is $\\boxed{4}$.", "type": "t", "idx": 0}
OLYMPIAD = {"id": 1, "question": "Find x.", "final_answer": ["$2$"], "context": "A line.",
            "unit": None, "error": None, "is_multiple_answer": False, "answer_type": "Numerical"}
HUMANEVAL = {"task_id": "HumanEval/0", "prompt": "def f(x):\n", "entry_point": "f",
             "canonical_solution": "    return x\n", "base_input": [[1]], "plus_input": [[2]],
             "atol": 0, "test": "def check(c):\n    pass\n"}
RLLM_CODE = {"problem": "Echo n.", "tests": [{"input": "5", "output": "5", "testtype": "stdin"}],
             "starter_code": "", "metadata": {"question_id": "q0"}}

BASE = {"verl": VERL, "verl_code": VERL_CODE, "math": MATH, "minerva": MINERVA,
        "olympiadbench": OLYMPIAD, "humanevalplus": HUMANEVAL, "rllm_code": RLLM_CODE}


def _write(tmp_path, name, rows, ext):
  path = tmp_path / f"{name}.{ext}"
  if ext == "parquet":
    pq.write_table(pa.Table.from_pylist(rows), str(path))
  else:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return str(path)


def _edit(base, dotted, value):
  """A deep copy of `base` with the field `dotted` ('a.b', or 'a.0.b' into lists) set or deleted."""
  row = copy.deepcopy(base)
  keys = dotted.split(".")
  node = row
  for k in keys[:-1]:
    node = node[int(k)] if isinstance(node, list) else node[k]
  last = int(keys[-1]) if isinstance(node, list) else keys[-1]
  if value is _DELETE:
    del node[last]
  else:
    node[last] = value
  return row


_DELETE = object()

# (base row, field, bad value, error regex after "<file>: row 0: ").
VERL_CASES = [
  ("verl", "reward_model", _DELETE, r"reward_model must be an object with ground_truth, got None"),
  ("verl", "reward_model.ground_truth", None, r"reward_model.ground_truth is missing or null"),
  ("verl", "reward_model.ground_truth", "None",
   r"reward_model.ground_truth is the string 'None'"),
  ("verl", "reward_model.ground_truth", " ", r"reward_model.ground_truth is empty: ' '"),
  ("verl", "reward_model.ground_truth", True,
   r"reward_model.ground_truth must be a string or a number, got bool True"),
  ("verl", "reward_model.ground_truth", {"a": 1},
   r"reward_model.ground_truth must be a string or a number, got dict \{'a': 1\}"),
  ("verl", "reward_model.ground_truth", [], r"reward_model.ground_truth is an empty list"),
  ("verl", "reward_model.ground_truth", ["1", None],
   r"reward_model.ground_truth\[1\] is missing or null"),
  ("verl", "reward_model.ground_truth", float("nan"),
   r"reward_model.ground_truth must be a finite number, got nan"),
  ("verl", "prompt", _DELETE, r"prompt is missing or null"),
  ("verl", "prompt", [], r"prompt is an empty chat-message list"),
  ("verl", "prompt", 42, r"prompt must be a string, got int 42"),
  ("verl", "prompt", ["hi"], r"prompt\[0\] must be a \{role, content\} object, got 'hi'"),
  ("verl", "prompt.0.content", None, r"prompt\[0\].content must be a string, got NoneType None"),
  ("verl", "prompt.0.role", None, r"prompt\[0\].role is missing or null"),
  ("verl", "prompt.0.content", "", r"prompt \(user message content\) is empty: ''"),
  ("verl", "data_source", 5, r"data_source must be a string, got int 5"),
  ("verl", "extra_info", "x", r"extra_info must be an object, got 'x'"),
  ("verl", "ability", 3, r"ability must be a string, got 3"),
  ("verl_code", "reward_model.ground_truth", None,
   r"reward_model.ground_truth is missing or null"),
  ("verl_code", "reward_model.ground_truth", "not json",
   r"reward_model.ground_truth: tests is a string but not JSON"),
  ("verl_code", "reward_model.ground_truth", json.dumps([{"input": None, "output": "1"}]),
   r"reward_model.ground_truth\[0\].input must be a string, got NoneType None"),
  ("verl_code", "reward_model.ground_truth", "[]",
   r"reward_model.ground_truth: tests must be a non-empty list"),
]

OTHER_CASES = [  # (format, field, bad value, regex)
  ("math", "problem", None, r"problem or question is missing or null"),
  ("math", "problem", 5, r"problem must be a string, got int 5"),
  ("math", "answer", _DELETE, r"answer is missing or null"),
  ("math", "answer", None, r"answer is missing or null"),
  ("math", "answer", "None", r"answer is the string 'None'"),
  ("math", "answer", ["1"], r"answer must be a string or a number, got list \['1'\]"),
  ("math", "answer", float("inf"), r"answer must be a finite number, got inf"),
  ("minerva", "solution", None, r"solution \(no answer field\) is missing or null"),
  ("minerva", "solution", "no box here", r"no answer field and no \\boxed\{\} in the solution"),
  ("olympiadbench", "final_answer", None, r"final_answer is missing or null"),
  ("olympiadbench", "final_answer", ["$2$", None], r"final_answer\[1\] is missing or null"),
  ("olympiadbench", "final_answer", ["$ $"], r"empty final_answer \['\$ \$'\]"),
  ("olympiadbench", "question", None, r"question or problem is missing or null"),
  ("olympiadbench", "context", 5, r"context must be a string, got int 5"),
  ("humanevalplus", "task_id", None, r"task_id is missing or null"),
  ("humanevalplus", "prompt", 5, r"prompt must be a string, got int 5"),
  ("humanevalplus", "entry_point", "", r"entry_point is empty: ''"),
  ("humanevalplus", "base_input", None, r"base_input is null"),
  ("rllm_code", "tests", None, r"tests is missing or null"),
  ("rllm_code", "tests", [], r"tests: tests must be a non-empty list"),
  ("rllm_code", "tests.0.output", None, r"tests\[0\].output must be a string, got NoneType None"),
  ("rllm_code", "tests.0.input", 3, r"tests\[0\].input must be a string, got int 3"),
  ("rllm_code", "starter_code", 5, r"starter_code must be a string, got int 5"),
  ("rllm_code", "tests.0.testtype", "functional",
   r"metadata.func_name \(functional tests need it\) is missing or null"),
]


def _fmt(base):
  return "verl" if base.startswith("verl") else base


@pytest.mark.parametrize("ext", ["jsonl", "parquet"])
@pytest.mark.parametrize("base,field,value,regex", VERL_CASES)
def test_verl_rows(tmp_path, ext, base, field, value, regex):
  good = load_prompts(_write(tmp_path, "good", [BASE[base]], ext))
  assert len(good) == 1 and good[0].ground_truth not in (None, "None")
  path = _write(tmp_path, "bad", [_edit(BASE[base], field, value)], ext)
  with pytest.raises(ValueError, match=re.escape(f"{path}: row 0: ") + regex):
    load_prompts(path, "verl")


@pytest.mark.parametrize("ext", ["jsonl", "parquet"])
@pytest.mark.parametrize("fmt,field,value,regex", OTHER_CASES)
def test_benchmark_rows(tmp_path, ext, fmt, field, value, regex):
  good = load_prompts(_write(tmp_path, "good", [BASE[fmt]], ext), fmt)
  assert len(good) == 1
  # jsonl: a good row first, so the error must name row 1; parquet: one row (a column cannot mix
  # the good and the bad value's types).
  rows = [BASE[fmt], _edit(BASE[fmt], field, value)] if ext == "jsonl" else [
    _edit(BASE[fmt], field, value)]
  path = _write(tmp_path, "bad", rows, ext)
  with pytest.raises(ValueError, match=re.escape(f"{path}: row {len(rows) - 1}: ") + regex):
    load_prompts(path, fmt)


def test_empty_files(tmp_path):
  for name, content in (("empty.jsonl", ""), ("blank.jsonl", "\n  \n"), ("empty.json", "[]")):
    (tmp_path / name).write_text(content)
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / name}: the file has no rows")):
      load_prompts(str(tmp_path / name), "math")
  empty_pq = str(tmp_path / "empty.parquet")
  pq.write_table(pa.table({"problem": pa.array([], pa.string()),
                           "answer": pa.array([], pa.string())}), empty_pq)
  with pytest.raises(ValueError, match=re.escape(f"{empty_pq}: the file has no rows")):
    load_prompts(empty_pq)
  (tmp_path / "zero.parquet").write_bytes(b"")
  with pytest.raises(ValueError, match=re.escape(f"{tmp_path / 'zero.parquet'}: not a readable "
                                                 "parquet file")):
    load_prompts(str(tmp_path / "zero.parquet"))
  with pytest.raises(ValueError, match=r"limit must be an int >= 1 or None, got 0"):
    load_prompts(empty_pq, limit=0)


def test_rows_that_are_not_objects_and_bad_json(tmp_path):
  good = json.dumps(MATH)
  path = tmp_path / "rows.jsonl"
  path.write_text(f"{good}\n[1, 2]\n")
  with pytest.raises(ValueError, match=re.escape(f"{path}:2: expected a JSON object per line, got "
                                                 "list [1, 2]")):
    load_prompts(str(path))
  path.write_text(f"{good}\n\n{{\"problem\": \"x\", \n")  # bad JSON on line 3 (line 2 is blank)
  with pytest.raises(ValueError, match=re.escape(f"{path}:3: invalid JSON")):
    load_prompts(str(path))
  path.write_text("null\n")
  with pytest.raises(ValueError, match=re.escape(f"{path}:1: expected a JSON object per line, got "
                                                 "NoneType None")):
    load_prompts(str(path))
  lst = tmp_path / "rows.json"
  lst.write_text(json.dumps([MATH, "just a string"]))
  with pytest.raises(ValueError, match=re.escape(f"{lst}: row 1: expected a JSON object, got str "
                                                 "'just a string'")):
    load_prompts(str(lst))
  lst.write_text('[{"problem": "x", "answer": "1"},')
  with pytest.raises(ValueError, match=re.escape(f"{lst}: invalid JSON")):
    load_prompts(str(lst))
  gz = tmp_path / "rows.jsonl.gz"
  gz.write_bytes(b"not gzip at all")
  with pytest.raises(ValueError, match=re.escape(f"{gz}: not a gzip file")):
    load_prompts(str(gz))
  with gzip.open(gz, "wb") as f:
    f.write(b"\xff\xfe not utf-8\n")
  with pytest.raises(ValueError, match=re.escape(f"{gz}: not UTF-8 text")):
    load_prompts(str(gz))


def test_nothing_none_reaches_grading_or_prompting(tmp_path):
  """Optional fields left null load, and no record carries None or the text 'None' onward."""
  rows = {
    "verl": [dict(VERL, data_source=None, extra_info=None, ability=None)],
    "math": [MATH],
    "minerva": [dict(MINERVA, answer=None)],
    "olympiadbench": [dict(OLYMPIAD, context=None)],
    "humanevalplus": [HUMANEVAL],
    "rllm_code": [dict(RLLM_CODE, starter_code=None, metadata=None)],
  }
  for fmt, rs in rows.items():
    for ext in ("jsonl", "parquet"):
      (rec,) = load_prompts(_write(tmp_path, f"{fmt}_ok", rs, ext), fmt)
      seen = json.dumps([rec.prompt, rec.prompt_text(), rec.reward_meta(), rec.prompt_id,
                         rec.data_source])
      assert "None" not in seen and "null" not in seen, (fmt, ext, seen)
      assert rec.prompt_text().strip()
  (rec,) = load_prompts(_write(tmp_path, "verl_src", rows["verl"], "jsonl"), "verl")
  assert rec.data_source == "verl_src" and rec.prompt_id == "verl_src/0"  # file name, not 'None'


def test_prompt_record_refuses_none_and_empty():
  with pytest.raises(ValueError, match=r"PromptRecord\(a\).ground_truth must be set .* got None"):
    data.PromptRecord("a", "p", None, "s")
  with pytest.raises(ValueError, match=r"PromptRecord\(a\).ground_truth must be set .* got 'None'"):
    data.PromptRecord("a", "p", "None", "s")
  with pytest.raises(ValueError, match=r"PromptRecord\(a\).prompt\[0\] role and content must be "
                                       r"str, got role='user', content=None"):
    data.PromptRecord("a", [{"role": "user", "content": None}], "1", "s")
  with pytest.raises(ValueError, match=r"PromptRecord\(a\): the prompt text is empty or 'None'"):
    data.PromptRecord("a", "None", "1", "s")
  with pytest.raises(ValueError, match=r"PromptRecord\(a\).prompt is an empty chat-message list"):
    data.PromptRecord("a", [], "1", "s")
  assert formats() == ("verl", "math", "minerva", "olympiadbench", "humanevalplus",
                       "rllm_code")  # every format is covered above
