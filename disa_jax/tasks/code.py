"""The code task: its prompt templates, its benchmark formats and its reward ('code').

- Templates (the DeepCoder / LiveCodeBench convention): a complete Python program reading stdin
  and writing stdout in a ```python fenced block (`code_prompt`), or the given starter code
  completed for function-call problems; HumanEval(+): complete the given function
  (`humaneval_prompt`).
- Formats (`disa_jax.tasks.prompts.load_prompts`):
  'humanevalplus': EvalPlus ``HumanEvalPlus*.jsonl[.gz]``; the ground truth is the whole record
  (for `disa_jax.rewards.code.run_humaneval`).
  'rllm_code': rllm code sets (LiveCodeBench, CodeForces): a json list (or jsonl) of ``{problem,
  tests: [{input, output, testtype?}], starter_code?, metadata?}``; ``tests`` may be a JSON string
  (or APPS/TACO ``{inputs, outputs}`` columns). The ground truth is the test list;
  LiveCodeBench's functional tests (``testtype == "functional"``) keep ``metadata.func_name`` in
  ``extra["func_name"]``.
  A veRL row's ground truth of the task is its JSON-encoded test list (`decode_tests`).
- Reward 'code': the response's last fenced code block is run in the sandbox
  (`disa_jax.rewards.code`). Meta, one of ``{"tests": [{"input": str, "output": str}, ...]}``
  (stdin/stdout; reward 1 iff all pass; tests with ``"testtype": "functional"`` are LiveCodeBench
  calls and need ``"func_name"``), or ``{"humaneval": <HumanEval+ record>}`` (function calls on base
  + plus inputs), with optional ``timeout_s`` (per case / per HumanEval run). Candidates are graded
  concurrently by a thread pool (``workers``, default 2): the threads only wait on sandbox
  subprocesses. No exact target.
"""
from __future__ import annotations

import concurrent.futures
import json
import os
from typing import Any, Mapping, Sequence

import numpy as np

from disa_jax.data import rows as rows_lib
from disa_jax.data import templates
from disa_jax.data.records import PromptRecord
from disa_jax.rewards import code as code_lib
from disa_jax.rewards import registry as reward_registry
from disa_jax.rewards.graded import Response
from disa_jax.tasks import registry
from disa_jax.tasks.base import PromptFormat, Task

__all__ = ["CODE_STDIO_INSTRUCTION", "CODE_FUNCTION_INSTRUCTION", "code_prompt", "humaneval_prompt",
           "decode_tests", "code_reward_fn", "TASK"]

CODE_STDIO_INSTRUCTION = (
  "Write a complete Python 3 program that solves the problem above. It must read the input from "
  "standard input and write the answer to standard output. Put the whole program in a single "
  "```python code block.")

CODE_FUNCTION_INSTRUCTION = (
  "Complete the following Python code so that it solves the problem above. Return the complete "
  "code, including the given signature, in a single ```python code block.")
def code_prompt(problem: str, starter_code: str | None = None) -> str:
  """The code prompt: stdin/stdout program, or completion of `starter_code` when given.

  Args:
    problem: the problem statement.
    starter_code: a function/class signature to complete (LiveCodeBench functional problems).

  Returns:
    The user-message text.
  """
  if not isinstance(problem, str) or not problem.strip():
    raise ValueError(f"problem must be a non-empty str, got {problem!r}")
  if starter_code:
    return (f"{problem.strip()}\n\n{CODE_FUNCTION_INSTRUCTION}\n\n```python\n"
            f"{starter_code.rstrip()}\n```")
  return f"{problem.strip()}\n\n{CODE_STDIO_INSTRUCTION}"


def humaneval_prompt(prompt: str) -> str:
  """The prompt for a HumanEval(+) task: complete the given function.

  Args:
    prompt: the task's `prompt` field (imports, signature, docstring).

  Returns:
    The user-message text.
  """
  return ("Complete the following Python function. Return the complete function, including its "
          f"signature and any imports, in a single ```python code block.\n\n```python\n"
          f"{prompt.rstrip()}\n```")



def decode_tests(tests: Any, where: str) -> list[dict[str, Any]]:
  """A test list: `[{input, output, testtype?}]`, a JSON string of one, or APPS/TACO columns."""
  if tests is None:
    raise ValueError(f"{where} is missing or null")
  if isinstance(tests, str):
    try:
      tests = json.loads(tests)
    except json.JSONDecodeError as e:
      raise ValueError(f"{where}: tests is a string but not JSON: {e}") from e
  if isinstance(tests, dict) and "inputs" in tests and "outputs" in tests:  # APPS/TACO columns
    tests = [{"input": i, "output": o} for i, o in zip(tests["inputs"], tests["outputs"])]
  if not isinstance(tests, list) or not tests:
    raise ValueError(f"{where}: tests must be a non-empty list of {{input, output}} objects, got "
                     f"{rows_lib.short(tests)}")
  for j, t in enumerate(tests):
    if not isinstance(t, dict):
      raise ValueError(f"{where}[{j}] must be an {{input, output}} object, got {rows_lib.short(t)}")
    for key in ("input", "output"):
      if not isinstance(t.get(key), str):
        raise ValueError(f"{where}[{j}].{key} must be a string, got "
                         f"{type(t.get(key)).__name__} {rows_lib.short(t.get(key))}")
  return tests


def _record_humanevalplus(row: Mapping[str, Any], i: int, src: str, where: str) -> PromptRecord:
  """An EvalPlus row: the whole record is the ground truth (`disa_jax.rewards.code.run_humaneval`)."""
  for key in ("task_id", "prompt", "entry_point", "canonical_solution"):
    rows_lib.text(row.get(key), f"{where}: {key}")
  for key in ("base_input", "plus_input"):
    if key in row and row[key] is None:
      raise ValueError(f"{where}: {key} is null")
  extra = {"ability": "code", "task_id": row["task_id"], "entry_point": row["entry_point"]}
  return PromptRecord(row["task_id"], templates.chat_messages(humaneval_prompt(row["prompt"])),
                      dict(row), src, extra)


def _code_metadata(row: Mapping[str, Any], where: str) -> dict[str, Any]:
  meta = row.get("metadata")
  if isinstance(meta, str):
    try:
      meta = json.loads(meta) if meta.strip() else {}
    except json.JSONDecodeError as e:
      raise ValueError(f"{where}: metadata is a string but not JSON: {e}") from e
  return meta if isinstance(meta, dict) else {}


def _record_rllm_code(row: Mapping[str, Any], i: int, src: str, where: str) -> PromptRecord:
  """An rllm code row: the test list is the ground truth; functional tests keep ``func_name``."""
  problem = rows_lib.first_text(row, ("problem", "question"), where)
  tests = decode_tests(row.get("tests"), f"{where}: tests")
  kinds = {t.get("testtype", "stdin") for t in tests}
  if kinds - {"stdin", "functional"} or len(kinds) > 1:
    raise ValueError(f"{where}: tests must be all 'stdin' or all 'functional', got test types "
                     f"{sorted(map(str, kinds))}")
  meta = _code_metadata(row, where)
  pid = rows_lib.row_id({**meta, **row}, i, ("id", "problem_id", "question_id", "idx"))
  extra = {k: v for k, v in row.items() if k not in ("problem", "question", "tests")}
  extra.update(ability="code", problem=problem)
  if kinds == {"functional"}:
    extra["func_name"] = rows_lib.text(meta.get("func_name"),
                                       f"{where}: metadata.func_name (functional tests need it)")
  starter = rows_lib.optional_text(row, "starter_code", where)
  return PromptRecord(f"{src}/{pid}", templates.chat_messages(code_prompt(problem, starter)),
                      tests, src, extra)


def _code_one(response: str, meta: Mapping[str, Any]) -> float:
  program = code_lib.extract_code(response)
  if "tests" in meta:
    timeout_s = float(meta.get("timeout_s", 6.0))
    tests = meta["tests"]
    if any(t.get("testtype") == "functional" for t in tests):
      if not meta.get("func_name"):
        raise ValueError("functional tests need 'func_name' in the meta")
      results = code_lib.run_functional(program, tests, meta["func_name"], timeout_s)
    else:
      results = code_lib.run_stdio(program, tests, timeout_s)
    return 1.0 if results and all(results) else 0.0
  if "humaneval" in meta:
    timeout_s = float(meta.get("timeout_s", 30.0))
    return 1.0 if code_lib.run_humaneval(meta["humaneval"], program, timeout_s) else 0.0
  raise ValueError(f"code meta needs 'tests' or 'humaneval', got keys {sorted(meta)}")


def code_reward_fn(responses: Sequence[Response], metas: Sequence[Mapping[str, Any]], *,
                   workers: int | None = None) -> np.ndarray:
  """The 'code' reward (module docstring).

  Args:
    responses: n responses (a fenced code block is extracted from each).
    metas: n dicts with `tests` or `humaneval`.
    workers: concurrent sandboxes (default `min(2, os.cpu_count())`).

  Returns:
    `[n]` float32.
  """
  reward_registry.check_lengths(responses, metas)
  for i, m in enumerate(metas):
    if "tests" not in m and "humaneval" not in m:
      raise ValueError(f"metas[{i}] needs 'tests' or 'humaneval' (keys: {sorted(m)})")
  workers = workers or min(2, os.cpu_count() or 1)
  texts = [r.text for r in responses]
  if workers == 1 or len(responses) <= 1:
    return np.asarray([_code_one(r, m) for r, m in zip(texts, metas)], np.float32)
  with concurrent.futures.ThreadPoolExecutor(workers) as ex:
    return np.asarray(list(ex.map(_code_one, texts, metas)), np.float32)


def _is_humanevalplus(keys: frozenset[str], base: str) -> bool:
  return {"entry_point", "canonical_solution"} <= keys


def _is_rllm_code(keys: frozenset[str], base: str) -> bool:
  return "tests" in keys and ("problem" in keys or "question" in keys)


FORMATS = (
  PromptFormat(name="humanevalplus", record=_record_humanevalplus, detect=_is_humanevalplus,
               detect_rank=10, benchmarks=("humanevalplus",)),
  PromptFormat(name="rllm_code", record=_record_rllm_code, detect=_is_rllm_code, detect_rank=20,
               benchmarks=("livecodebench", "codeforces")),
)
TASK = Task("code", formats=FORMATS, ground_truth=decode_tests)
registry.register_task(TASK, reward=code_reward_fn)
