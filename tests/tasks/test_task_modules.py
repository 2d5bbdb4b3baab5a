"""A task in one module (issue 64, item 4): each built-in task's module holds its prompt formats,
its template and its reward, registered once in `disa_jax.tasks.registry`; prompt files load to the
same records as before the loaders left `disa_jax.data`; a plugin task brings its own format."""
import dataclasses
import hashlib
import json
import os
import pathlib
import subprocess
import sys

import pytest

from disa_jax.data import templates
from disa_jax.data.records import PromptRecord
from disa_jax.data.rows import save_prompts
from disa_jax.tasks import PromptFormat, Task, get_task, prompts, register_task, registry
from disa_jax.tasks import code as code_task
from disa_jax.tasks import math as math_task
from disa_jax.tasks import sum as sum_task

ROOT = pathlib.Path(__file__).resolve().parents[2]
FIX = ROOT / "tests" / "fixtures" / "benchmarks"

# sha256[:16] of the records' canonical JSON (`_canon`) as `disa_jax.data.loaders` (main 4aea750,
# before the move) loaded each case: the formats moved, the records did not change.
BEFORE = {
  "aime24_qwen25math_sample.jsonl:auto": "941b8d7b2ef58c4d",
  "aime24_qwen25math_sample.jsonl:aime24": "941b8d7b2ef58c4d",
  "aime24_rllm_sample.json:auto": "48a052d5790af2be",
  "aime25_areal_sample.jsonl:auto": "cfcaed1297837f1c",
  "aime25_skywork_or1_sample.parquet:auto": "9bb76af3432278a9",
  "amc23_qwen25math_sample.jsonl:auto": "b9217075d48e2a53",
  "amc23_qwen25math_sample.jsonl:minerva": "b9217075d48e2a53",
  "amc_2022_2023_rllm_sample.json:auto": "d1b27e7286caf485",
  "humanevalplus_sample.jsonl.gz:auto": "4e24717798b97eaa",
  "humanevalplus_sample.jsonl.gz:humanevalplus": "4e24717798b97eaa",
  "math500_simplerl_sample.jsonl:auto": "34dcd20b9915a60a",
  "math500_simplerl_sample.jsonl:math500": "34dcd20b9915a60a",
  "rows:math": "191abe649b750a80",
  "rows:minerva": "40dee99b980c5513",
  "rows:olympiadbench": "b24ff1ac109d7ca1",
  "rows:rllm_code": "25ac399787b32949",
  "rows:verl": "b7779b37d4f2dbdd",
}

# made-up rows of every format (numbers, lists, JSON-string tests, APPS columns, plugin abilities)
ROWS = {
  "minerva": [{"problem": "Compute 2+2.", "solution": "It is $\\boxed{4}$.", "type": "Astro",
               "idx": 0},
              {"problem": "Mass?", "solution": "So \\boxed{3}", "idx": 1, "answer": 3e5}],
  "olympiadbench": [{"id": 2231, "question": "Find x.", "final_answer": ["$\\frac{1}{2}$", 3],
                     "context": None, "unit": None},
                    {"id": 2232, "question": "Find speed.", "final_answer": "$3$",
                     "context": "A car.", "unit": "m/s"}],
  "rllm_code": [{"problem": "Add.", "tests": json.dumps([{"input": "1 2\n", "output": "3\n",
                                                          "testtype": "stdin"}]),
                 "starter_code": "", "metadata": {"question_id": "abc"}},
                {"problem": "Two.", "starter_code": "class S:\n  def f(self):",
                 "tests": [{"input": "[2]", "output": "[0]", "testtype": "functional"}],
                 "metadata": json.dumps({"func_name": "f"})},
                {"question": "P.", "tests": {"inputs": ["1"], "outputs": ["2"]}, "id": 9}],
  "math": [{"question": "Q?", "answer": 27.0, "unique_id": "u1"},
           {"problem": "R?", "answer": 5, "extra_key": [1, 2]}],
  "verl": [{"prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
            "data_source": "dapo", "reward_model": {"ground_truth": ["1", 2]},
            "extra_info": {"index": 3}},
           {"prompt": "plain", "reward_model": {"ground_truth": json.dumps(
               [{"input": "1", "output": "1"}])}, "extra_info": {"id": "x"}},
           {"prompt": "sum", "ability": "sum_task", "reward_model": {"ground_truth": "5"},
            "extra_info": {"prompt_id": "src/sum0005"}, "data_source": "src"},
           {"prompt": "toy", "ability": "toy_contains", "reward_model": {"ground_truth": 7.5}},
           {"prompt": "c", "reward_model": {"ground_truth": [{"input": "1", "output": "2"}]},
            "extra_info": {"ability": "code", "idx": 1}}],
}


def _canon(records):
  return json.dumps([dataclasses.asdict(r) | {"t": type(r.ground_truth).__name__} for r in records],
                    sort_keys=True, default=repr)


def _digest(records):
  return hashlib.sha256(_canon(records).encode()).hexdigest()[:16]


def test_prompt_files_load_to_the_records_they_loaded_to_before_the_move():
  got = {}
  for case in BEFORE:
    source, fmt = case.rsplit(":", 1)
    if source == "rows":
      got[case] = _digest(prompts.records_from_rows(ROWS[fmt], fmt, where="w", data_source="src"))
      auto = prompts.records_from_rows(ROWS[fmt], "auto", where=f"{fmt}.jsonl", data_source="src")
      assert _digest(auto) == got[case], f"{case}: 'auto' detected another format"
    else:
      got[case] = _digest(prompts.load_prompts(str(FIX / source), fmt))
  assert got == BEFORE


@pytest.mark.parametrize("module,formats,template", [
  (math_task, ("math", "minerva", "olympiadbench"), math_task.math_prompt),
  (code_task, ("humanevalplus", "rllm_code"), code_task.code_prompt),
  (sum_task, (), sum_task.SumTask.prompt),
])
def test_each_built_in_task_lives_in_its_own_module(module, formats, template):
  task = get_task(module.TASK.name)
  assert task is module.TASK
  assert tuple(f.name for f in task.formats) == formats
  assert all(f.record.__module__ == module.__name__ for f in task.formats)
  assert template.__module__ == module.__name__
  assert all(registry.prompt_format(f) is fmt for f, fmt in zip(formats, task.formats))


def test_the_rewards_package_alone_registers_no_task_and_the_tasks_register_theirs():
  code = ("import disa_jax.rewards as r; assert r.reward_names() == [], r.reward_names(); "
          "import disa_jax.tasks; print(r.reward_names())")
  out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)},
                       timeout=300)
  assert out.returncode == 0, out.stderr
  assert out.stdout.strip() == "['code', 'math', 'sum_task']"


def _caps_record(row, i, src, where):
  """A plugin's format: ``{"word": w}`` -> "Shout w.", ground truth W."""
  if not isinstance(row.get("word"), str):
    raise ValueError(f"{where}: word must be a string, got {row.get('word')!r}")
  return PromptRecord(f"{src}/{i}", templates.chat_messages(f"Shout {row['word']}."),
                      row["word"].upper(), src, {"ability": "t64_caps"})


def _caps_truth(value, where):
  if not isinstance(value, str) or not value.isupper():
    raise ValueError(f"{where} must be upper-case text, got {value!r}")
  return value


def test_a_plugin_task_brings_its_own_prompt_format_and_ground_truth(tmp_path):
  fmt = PromptFormat(name="t64_caps_rows", record=_caps_record, detect_rank=5,
                     detect=lambda keys, base: "word" in keys, benchmarks=("t64_caps_bench",))
  register_task(Task("t64_caps", formats=(fmt,), ground_truth=_caps_truth),
                reward=lambda rs, ms: [float(r.text == m["ground_truth"]) for r, m in zip(rs, ms)])
  path = tmp_path / "caps.jsonl"
  path.write_text('{"word": "hi"}\n{"word": "yo"}\n')
  for how in ("auto", "t64_caps_rows", "t64_caps_bench"):
    recs = prompts.load_prompts(str(path), how)
    assert [(r.prompt_id, r.ground_truth, r.ability) for r in recs] == [
        ("caps/0", "HI", "t64_caps"), ("caps/1", "YO", "t64_caps")]
  assert "t64_caps_rows" in prompts.formats()
  assert prompts.benchmark_formats()["t64_caps_bench"] == "t64_caps_rows"
  save_prompts(recs, str(tmp_path / "caps_verl.jsonl"))  # stored as veRL rows: its ground truth
  back = prompts.load_prompts(str(tmp_path / "caps_verl.jsonl"))  # checked by the task
  assert [(r.prompt_id, r.ground_truth, r.ability) for r in back] == [
      (r.prompt_id, r.ground_truth, r.ability) for r in recs]
  bad = tmp_path / "bad_verl.jsonl"
  bad.write_text(json.dumps({"prompt": "p", "ability": "t64_caps",
                             "reward_model": {"ground_truth": "lower"}}) + "\n")
  with pytest.raises(ValueError, match=r"row 0: reward_model.ground_truth must be upper-case text, "
                                       r"got 'lower'"):
    prompts.load_prompts(str(bad))
  with pytest.raises(ValueError, match="prompt format 't64_caps_rows' is already registered"):
    register_task(Task("t64_caps_again", formats=(fmt,)), reward=lambda rs, ms: [0.0] * len(rs))
  assert "t64_caps_again" not in registry.task_names()
  clash = PromptFormat(name="t64_caps_other", record=_caps_record, detect_rank=6,
                       detect=lambda keys, base: False, benchmarks=("aime24",))
  with pytest.raises(ValueError, match=r"prompt format 't64_caps_other': benchmark\(s\) \['aime24'\] "
                                       "already have a format"):
    register_task(Task("t64_caps_clash", formats=(clash,)), reward=lambda rs, ms: [0.0] * len(rs))
  assert "t64_caps_clash" not in registry.task_names()  # nothing registered
  with pytest.raises(KeyError, match="unknown prompt format 'nope'"):
    registry.prompt_format("nope")
