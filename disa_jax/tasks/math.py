"""The math task: its prompt template, its benchmark formats and its reward ('math').

- Template: the problem followed by the boxed-answer instruction (`math_prompt`). The paper does
  not print its templates; `MATH_INSTRUCTION` is the standard Qwen2.5-Math one,
  `MATH_INSTRUCTION_DEEPSCALER` the DeepScaleR/rllm variant.
- Formats (`disa_jax.tasks.prompts.load_prompts`):
  'math': rows (jsonl, json list, or parquet) with ``problem``/``question`` and ``answer`` (AIME
  2024/2025, AMC 2023, MATH-500 in the Qwen2.5-Math / simpleRL / AReaL / rllm copies); the ground
  truth is the ``answer`` string (numbers such as AMC's 27.0 become "27.0").
  'minerva': Minerva-Math rows (``problem``, ``solution``, optional ``answer``); the answer is the
  last ``\\boxed{}`` of the solution when there is no ``answer`` field.
  'olympiadbench': OlympiadBench rows (``question``, ``final_answer`` list, ``context``, ``unit``,
  ``error``, ``is_multiple_answer``, ``answer_type``); the ground truth is the ``final_answer``
  list of acceptable answers with ``$`` stripped; the row's other fields go to ``extra``.
- Reward 'math': meta ``{"ground_truth": str | number | list of acceptable answers}`` (optional
  ``timeout_s``), graded by `disa_jax.rewards.math_rewards` (math-verify in a time-bounded worker
  pool). No exact target (its correct set cannot be enumerated).
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from disa_jax.data import rows as rows_lib
from disa_jax.data import templates
from disa_jax.data.records import PromptRecord
from disa_jax.rewards import math_answer, math_pool
from disa_jax.rewards import registry as reward_registry
from disa_jax.rewards.graded import Graded, Response
from disa_jax.tasks import registry
from disa_jax.tasks.base import PromptFormat, Task

__all__ = ["MATH_INSTRUCTION", "MATH_INSTRUCTION_DEEPSCALER", "math_prompt", "math_reward_fn",
           "TASK"]

MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
MATH_INSTRUCTION_DEEPSCALER = (
  "Let's think step by step and output the final answer within \\boxed{}.")


def math_prompt(problem: str, instruction: str = MATH_INSTRUCTION) -> str:
  """The math prompt: the problem followed by the boxed-answer instruction.

  Args:
    problem: the problem statement.
    instruction: the instruction appended after a blank line.

  Returns:
    The user-message text.
  """
  if not isinstance(problem, str) or not problem.strip():
    raise ValueError(f"problem must be a non-empty str, got {problem!r}")
  return f"{problem.strip()}\n\n{instruction}"


def _record(src: str, pid: str, problem: str, gt: Any, row: Mapping[str, Any],
            consumed: tuple[str, ...]) -> PromptRecord:
  """A math benchmark prompt: the math template; the row's other fields kept in ``extra``."""
  extra = {k: v for k, v in row.items() if k not in consumed}
  extra.update(ability="math", problem=problem)
  return PromptRecord(f"{src}/{pid}", templates.chat_messages(math_prompt(problem)), gt, src, extra)


def _record_math(row: Mapping[str, Any], i: int, src: str, where: str) -> PromptRecord:
  """A math benchmark row: ``problem``/``question`` and ``answer``."""
  problem = rows_lib.first_text(row, ("problem", "question"), where)
  gt = rows_lib.answer_text(row.get("answer"), f"{where}: answer")
  pid = rows_lib.row_id(row, i, ("unique_id", "id", "idx"))
  return _record(src, pid, problem, gt, row, ("problem", "question", "answer"))


def _record_minerva(row: Mapping[str, Any], i: int, src: str, where: str) -> PromptRecord:
  """A Minerva-Math row: ``answer``, else the last ``\\boxed{}`` of the ``solution``."""
  problem = rows_lib.first_text(row, ("problem", "question"), where)
  if row.get("answer") not in (None, ""):
    gt = rows_lib.answer_text(row["answer"], f"{where}: answer")
  else:
    solution = rows_lib.text(row.get("solution"), f"{where}: solution (no answer field)")
    gt = math_answer.extract_boxed(solution)
    if not gt:
      raise ValueError(f"{where}: no answer field and no \\boxed{{}} in the solution")
  pid = rows_lib.row_id(row, i, ("idx", "id", "unique_id"))
  return _record(src, pid, problem, gt, row, ("problem", "question", "answer"))


def _final_answers(row: Mapping[str, Any], where: str) -> list[str]:
  """OlympiadBench's ``final_answer``: the acceptable answers, ``$`` stripped."""
  fa = row.get("final_answer")
  if hasattr(fa, "tolist"):
    fa = fa.tolist()
  if fa is None:
    raise ValueError(f"{where}: final_answer is missing or null")
  answers = fa if isinstance(fa, list) else [fa]
  gt = [a.strip().strip("$").strip() if isinstance(a, str)
        else rows_lib.answer_text(a, f"{where}: final_answer[{j}]") for j, a in enumerate(answers)]
  gt = [a for a in gt if a]
  if not gt:
    raise ValueError(f"{where}: empty final_answer {fa!r}")
  for j, a in enumerate(gt):
    rows_lib.text(a, f"{where}: final_answer[{j}]")
  return gt


def _record_olympiadbench(row: Mapping[str, Any], i: int, src: str, where: str) -> PromptRecord:
  """An OlympiadBench row: its ``context`` before the question; ``final_answer`` the answers."""
  question = rows_lib.first_text(row, ("question", "problem"), where)
  gt = _final_answers(row, where)
  context = rows_lib.optional_text(row, "context", where)
  problem = question if not context else f"{context}\n\n{question}"
  pid = rows_lib.row_id(row, i, ("id", "idx", "unique_id"))
  return _record(src, pid, problem, gt, row, ("question", "final_answer"))


def math_reward_fn(responses: Sequence[Response], metas: Sequence[Mapping[str, Any]], *,
                   workers: int = 2) -> Graded:
  """The 'math' reward (module docstring).

  Args:
    responses: n responses.
    metas: n dicts with ``ground_truth`` (and optionally ``timeout_s``, the same for the batch).
    workers: grading processes.

  Returns:
    `Graded`: ``[n]`` float32 rewards and the items whose grading failed.
  """
  reward_registry.check_lengths(responses, metas)
  gts = []
  for i, m in enumerate(metas):
    if "ground_truth" not in m:
      raise ValueError(f"metas[{i}] has no 'ground_truth' (keys: {sorted(m)})")
    gts.append(m["ground_truth"])
  timeout_s = float(metas[0].get("timeout_s", math_pool.DEFAULT_TIMEOUT_S)) if metas else 1.0
  return math_pool.math_rewards([r.text for r in responses], gts, timeout_s=timeout_s,
                                workers=workers, return_errors=True)


def _is_math(keys: frozenset[str], base: str) -> bool:
  return ("problem" in keys or "question" in keys) and "answer" in keys


def _is_minerva(keys: frozenset[str], base: str) -> bool:
  return "minerva" in base or ("solution" in keys and "answer" not in keys and "type" in keys)


FORMATS = (
  PromptFormat(name="math", record=_record_math, detect=_is_math, detect_rank=50,
               benchmarks=("aime24", "aime25", "amc23", "math500")),
  PromptFormat(name="minerva", record=_record_minerva, detect=_is_minerva, detect_rank=40,
               benchmarks=("minerva",)),
  PromptFormat(name="olympiadbench", record=_record_olympiadbench, detect_rank=30,
               detect=lambda keys, base: "final_answer" in keys, benchmarks=("olympiadbench",)),
)
TASK = Task("math", formats=FORMATS)
registry.register_task(TASK, reward=math_reward_fn)
