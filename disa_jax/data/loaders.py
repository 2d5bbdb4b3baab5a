"""Loaders for prompt datasets and benchmarks in their published formats -> `PromptRecord`s.

`load_prompts(path, fmt='auto', *, data_source=None, limit=None)` reads:

- `'verl'`: veRL parquet or jsonl rows with `prompt` (chat-message list or str), `data_source`,
  `reward_model.ground_truth`, `extra_info` (and `ability`). Code ground truths stored as JSON
  strings are decoded to test lists.
- `'math'`: math benchmark rows (jsonl, json list, or parquet) with `problem`/`question` and
  `answer` — AIME 2024/2025, AMC 2023, MATH-500 in the Qwen2.5-Math / simpleRL / AReaL / rllm
  copies. The ground truth is the `answer` string (numbers such as AMC's 27.0 become "27.0").
- `'minerva'`: Minerva-Math rows (`problem`, `solution`, optional `answer`); the answer is the
  last `\\boxed{}` of the solution when there is no `answer` field.
- `'olympiadbench'`: OlympiadBench rows (`question`, `final_answer` list, `context`, `unit`,
  `error`, `is_multiple_answer`, `answer_type`); the ground truth is the `final_answer` list of
  acceptable answers with `$` stripped; `unit`/`error`/`answer_type` go to `extra`.
- `'humanevalplus'`: EvalPlus `HumanEvalPlus*.jsonl[.gz]`; the ground truth is the whole record
  (for `run_humaneval`); the prompt is `humaneval_prompt(record['prompt'])`.
- `'rllm_code'`: rllm code sets (LiveCodeBench, CodeForces): a json list (or jsonl) of
  `{problem, tests: [{input, output, testtype?}], starter_code?, metadata?}`; `tests` may be a JSON
  string. The ground truth is the test list; LiveCodeBench's functional tests
  (`testtype == "functional"`) keep `metadata.func_name` in `extra["func_name"]`.

`'auto'` picks the format from the path and the first row's keys. Prompts of non-veRL formats are
a one-message chat list with the paper's template applied (`disa_jax.data.templates`).
`save_prompts(records, path)` writes veRL jsonl or parquet.
"""

from __future__ import annotations

import gzip
import json
import os
from typing import Any, Iterable, Mapping, Sequence

from disa_jax.data import templates
from disa_jax.data.records import PromptRecord
from disa_jax.rewards import math_answer

__all__ = ["FORMATS", "BENCHMARK_FORMATS", "load_prompts", "save_prompts", "detect_format",
           "read_rows"]

FORMATS = ("verl", "math", "minerva", "olympiadbench", "humanevalplus", "rllm_code")
# Benchmark name -> loader format (and the ability it is graded with).
BENCHMARK_FORMATS = {
  "aime24": "math", "aime25": "math", "amc23": "math", "math500": "math", "minerva": "minerva",
  "olympiadbench": "olympiadbench", "humanevalplus": "humanevalplus",
  "livecodebench": "rllm_code", "codeforces": "rllm_code",
}


def read_rows(path: str) -> list[dict[str, Any]]:
  """Rows of a .jsonl / .json (list) / .parquet file, optionally .gz-compressed (json/jsonl).

  Raises:
    ValueError: on an unknown extension or a json file that is not a list of objects.
  """
  name = path[:-3] if path.endswith(".gz") else path
  if not name.endswith((".parquet", ".jsonl", ".json")):
    raise ValueError(f"{path}: unknown file type (expected .jsonl, .json, .parquet; json/jsonl "
                     "may be .gz)")
  if name.endswith(".parquet"):
    import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
    return pq.read_table(path).to_pylist()
  opener = gzip.open if path.endswith(".gz") else open
  with opener(path, "rt", encoding="utf-8") as f:
    if name.endswith(".jsonl"):
      rows = []
      for lineno, line in enumerate(f, 1):
        if line.strip():
          try:
            rows.append(json.loads(line))
          except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: invalid JSON: {e}") from e
      return rows
    data = json.load(f)
  if isinstance(data, dict):  # {id: row} maps
    data = list(data.values())
  if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
    raise ValueError(f"{path}: expected a JSON list of objects")
  return data


def detect_format(path: str, rows: Sequence[dict[str, Any]]) -> str:
  """Guesses the format of `rows` read from `path` (see module docstring).

  Raises:
    ValueError: when no format fits.
  """
  if not rows:
    raise ValueError(f"{path}: no rows")
  keys = set(rows[0])
  base = os.path.basename(path).lower()
  if "reward_model" in keys and "prompt" in keys:
    return "verl"
  if {"entry_point", "canonical_solution"} <= keys:
    return "humanevalplus"
  if "tests" in keys and ("problem" in keys or "question" in keys):
    return "rllm_code"
  if "final_answer" in keys:
    return "olympiadbench"
  if "minerva" in base or ("solution" in keys and "answer" not in keys and "type" in keys):
    return "minerva"
  if ("problem" in keys or "question" in keys) and "answer" in keys:
    return "math"
  raise ValueError(f"{path}: cannot detect the format from keys {sorted(keys)}; pass fmt= one of "
                   f"{FORMATS}")


def _source_name(path: str) -> str:
  base = os.path.basename(path)
  for ext in (".gz", ".jsonl", ".json", ".parquet"):
    if base.endswith(ext):
      base = base[:-len(ext)]
  return base


def _row_id(row: dict[str, Any], i: int, keys: Iterable[str]) -> str:
  for k in keys:
    if row.get(k) not in (None, ""):
      return str(row[k])
  return str(i)


def _answer_str(value: Any, where: str) -> str:
  if isinstance(value, bool) or value is None:
    raise ValueError(f"{where}: answer must be a string or a number, got {value!r}")
  if isinstance(value, (int, float)):
    return repr(value) if isinstance(value, float) else str(value)
  return str(value).strip()


def _decode_tests(tests: Any, where: str) -> list[dict[str, Any]]:
  if isinstance(tests, str):
    try:
      tests = json.loads(tests)
    except json.JSONDecodeError as e:
      raise ValueError(f"{where}: tests is a string but not JSON: {e}") from e
  if isinstance(tests, dict) and "inputs" in tests and "outputs" in tests:  # APPS/TACO columns
    tests = [{"input": i, "output": o} for i, o in zip(tests["inputs"], tests["outputs"])]
  if not isinstance(tests, list) or not all(
      isinstance(t, dict) and "input" in t and "output" in t for t in tests):
    raise ValueError(f"{where}: tests must be a list of {{input, output}} objects")
  return tests


def _load_verl(rows, src):
  out = []
  for i, row in enumerate(rows):
    where = f"{src}[{i}]"
    rm = row.get("reward_model")
    if not isinstance(rm, dict) or "ground_truth" not in rm:
      raise ValueError(f"{where}: reward_model.ground_truth missing (row keys {sorted(row)})")
    extra = dict(row.get("extra_info") or {})
    ability = row.get("ability") or extra.get("ability")
    gt = rm["ground_truth"]
    if ability == "code" or (isinstance(gt, str) and gt.lstrip().startswith("[{")):
      gt = _decode_tests(gt, where + ".reward_model.ground_truth")
      ability = "code"
    elif hasattr(gt, "tolist"):  # numpy arrays from pandas-written parquet
      gt = gt.tolist()
    extra["ability"] = ability or "math"
    prompt = row["prompt"]
    if hasattr(prompt, "tolist"):
      prompt = prompt.tolist()
    if isinstance(prompt, list):
      prompt = [{"role": str(m["role"]), "content": str(m["content"])} for m in prompt]
    pid = extra.get("prompt_id") or _row_id(extra, i, ("id", "index", "idx"))
    out.append(PromptRecord(f"{row.get('data_source', src)}/{pid}", prompt, gt,
                            str(row.get("data_source", src)), extra))
  return out


def _math_record(src: str, pid: str, problem: str, gt: Any, row: Mapping[str, Any],
                 consumed: tuple[str, ...]) -> PromptRecord:
  """A math benchmark prompt: the paper's math template; the row's other fields kept in ``extra``."""
  extra = {k: v for k, v in row.items() if k not in consumed}
  extra.update(ability="math", problem=problem)
  return PromptRecord(f"{src}/{pid}", templates.chat_messages(templates.math_prompt(problem)), gt,
                      src, extra)


def _load_math(rows, src):
  out = []
  for i, row in enumerate(rows):
    problem = row.get("problem", row.get("question"))
    if problem is None or "answer" not in row:
      raise ValueError(f"{src}[{i}]: a math row needs problem/question and answer, has "
                       f"{sorted(row)}")
    gt = _answer_str(row["answer"], f"{src}[{i}].answer")
    pid = _row_id(row, i, ("unique_id", "id", "idx"))
    out.append(_math_record(src, pid, problem, gt, row, ("problem", "question", "answer")))
  return out


def _load_minerva(rows, src):
  out = []
  for i, row in enumerate(rows):
    problem = row.get("problem", row.get("question"))
    if problem is None:
      raise ValueError(f"{src}[{i}]: a Minerva row needs problem, has {sorted(row)}")
    if row.get("answer") not in (None, ""):
      gt = _answer_str(row["answer"], f"{src}[{i}].answer")
    else:
      gt = math_answer.extract_boxed(str(row.get("solution", "")))
      if not gt:
        raise ValueError(f"{src}[{i}]: no answer field and no \\boxed{{}} in the solution")
    pid = _row_id(row, i, ("idx", "id", "unique_id"))
    out.append(_math_record(src, pid, problem, gt, row, ("problem", "question", "answer")))
  return out


def _load_olympiadbench(rows, src):
  out = []
  for i, row in enumerate(rows):
    question = row.get("question", row.get("problem"))
    fa = row.get("final_answer")
    if question is None or fa is None:
      raise ValueError(f"{src}[{i}]: an OlympiadBench row needs question and final_answer, has "
                       f"{sorted(row)}")
    if hasattr(fa, "tolist"):
      fa = fa.tolist()
    answers = fa if isinstance(fa, list) else [fa]
    gt = [a.strip().strip("$").strip() if isinstance(a, str) else _answer_str(a, f"{src}[{i}]")
          for a in answers]
    gt = [a for a in gt if a]
    if not gt:
      raise ValueError(f"{src}[{i}]: empty final_answer {fa!r}")
    problem = question if not row.get("context") else f"{row['context']}\n\n{question}"
    pid = _row_id(row, i, ("id", "idx", "unique_id"))
    out.append(_math_record(src, pid, problem, gt, row, ("question", "final_answer")))
  return out


def _load_humanevalplus(rows, src):
  out = []
  for i, row in enumerate(rows):
    for key in ("task_id", "prompt", "entry_point", "canonical_solution"):
      if key not in row:
        raise ValueError(f"{src}[{i}]: a HumanEval+ row needs {key!r}, has {sorted(row)}")
    extra = {"ability": "code", "task_id": row["task_id"], "entry_point": row["entry_point"]}
    out.append(PromptRecord(str(row["task_id"]),
                            templates.chat_messages(templates.humaneval_prompt(row["prompt"])),
                            dict(row), src, extra))
  return out


def _load_rllm_code(rows, src):
  out = []
  for i, row in enumerate(rows):
    problem = row.get("problem", row.get("question"))
    if problem is None or "tests" not in row:
      raise ValueError(f"{src}[{i}]: a code row needs problem and tests, has {sorted(row)}")
    tests = _decode_tests(row["tests"], f"{src}[{i}].tests")
    kinds = {t.get("testtype", "stdin") for t in tests}
    if kinds - {"stdin", "functional"} or len(kinds) > 1:
      raise ValueError(f"{src}[{i}]: tests must be all 'stdin' or all 'functional', got test types "
                       f"{sorted(kinds)}")
    meta = row.get("metadata")
    if isinstance(meta, str):
      try:
        meta = json.loads(meta) if meta.strip() else {}
      except json.JSONDecodeError as e:
        raise ValueError(f"{src}[{i}].metadata is a string but not JSON: {e}") from e
    meta = meta if isinstance(meta, dict) else {}
    pid = _row_id({**meta, **row}, i, ("id", "problem_id", "question_id", "idx"))
    extra = {k: v for k, v in row.items() if k not in ("problem", "question", "tests")}
    extra.update(ability="code", problem=problem)
    if kinds == {"functional"}:
      if not meta.get("func_name"):
        raise ValueError(f"{src}[{i}]: functional tests need metadata.func_name")
      extra["func_name"] = meta["func_name"]
    starter = row.get("starter_code") or None
    out.append(PromptRecord(f"{src}/{pid}",
                            templates.chat_messages(templates.code_prompt(problem, starter)),
                            tests, src, extra))
  return out


_LOADERS = {"verl": _load_verl, "math": _load_math, "minerva": _load_minerva,
            "olympiadbench": _load_olympiadbench, "humanevalplus": _load_humanevalplus,
            "rllm_code": _load_rllm_code}


def load_prompts(path: str, fmt: str = "auto", *, data_source: str | None = None,
                 limit: int | None = None) -> list[PromptRecord]:
  """Loads a prompt file as `PromptRecord`s (formats: see module docstring).

  Args:
    path: .jsonl / .json / .parquet (json/jsonl may be .gz).
    fmt: 'auto' or one of `FORMATS`; a benchmark name of `BENCHMARK_FORMATS` is accepted too.
    data_source: the records' data source (default: the file's base name; veRL rows keep theirs).
    limit: keep only the first `limit` rows.

  Returns:
    The records, in file order.

  Raises:
    ValueError: on an unknown format or a malformed row (the message names the row and field).
  """
  fmt = BENCHMARK_FORMATS.get(fmt, fmt)
  if fmt != "auto" and fmt not in FORMATS:
    raise ValueError(f"fmt must be 'auto', one of {FORMATS} or a benchmark of "
                     f"{sorted(BENCHMARK_FORMATS)}, got {fmt!r}")
  rows = read_rows(path)
  if limit is not None:
    rows = rows[:limit]
  if fmt == "auto":
    fmt = detect_format(path, rows)
  src = data_source or _source_name(path)
  records = _LOADERS[fmt](rows, src)
  seen = set()
  for r in records:
    if r.prompt_id in seen:
      raise ValueError(f"{path}: duplicate prompt_id {r.prompt_id!r}")
    seen.add(r.prompt_id)
  return records


def save_prompts(records: Sequence[PromptRecord], path: str) -> None:
  """Writes records as veRL rows (`.jsonl` or `.parquet`).

  Raises:
    ValueError: on another extension.
  """
  rows = [r.to_verl_row() for r in records]
  if path.endswith(".parquet"):
    import pyarrow as pa  # pylint: disable=g-import-not-at-top
    import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
    pq.write_table(pa.Table.from_pylist(rows), path)
  elif path.endswith(".jsonl"):
    with open(path, "w", encoding="utf-8") as f:
      for row in rows:
        f.write(json.dumps(row) + "\n")
  else:
    raise ValueError(f"save_prompts: path must end in .jsonl or .parquet, got {path!r}")
