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
`save_prompts(records, path)` writes veRL jsonl or parquet. A path may be a URL (``gs://``,
`disa_jax.paths`).
"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import math
import os
from typing import Any, Iterable, Mapping, Sequence

from disa_jax import paths
from disa_jax.data import parquet, templates
from disa_jax.data.records import PromptRecord
from disa_jax.rewards import math_answer

__all__ = ["FORMATS", "BENCHMARK_FORMATS", "load_prompts", "save_prompts", "detect_format",
           "read_rows", "records_from_rows"]

FORMATS = ("verl", "math", "minerva", "olympiadbench", "humanevalplus", "rllm_code")
# Benchmark name -> loader format (and the ability it is graded with).
BENCHMARK_FORMATS = {
  "aime24": "math", "aime25": "math", "amc23": "math", "math500": "math", "minerva": "minerva",
  "olympiadbench": "olympiadbench", "humanevalplus": "humanevalplus",
  "livecodebench": "rllm_code", "codeforces": "rllm_code",
}


def _short(value: Any, limit: int = 80) -> str:
  """`repr(value)`, cut to `limit` characters (values are quoted in errors)."""
  text = repr(value)
  return text if len(text) <= limit else text[:limit - 3] + "..."


def _json_rows(path: str, name: str, f) -> list[Any]:
  """The rows of an open .jsonl / .json text stream (unvalidated)."""
  if name.endswith(".jsonl"):
    rows = []
    for lineno, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        row = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{lineno}: invalid JSON: {e}") from e
      if not isinstance(row, dict):
        raise ValueError(f"{path}:{lineno}: expected a JSON object per line, got "
                         f"{type(row).__name__} {_short(row)}")
      rows.append(row)
    return rows
  try:
    data = json.load(f)
  except json.JSONDecodeError as e:
    raise ValueError(f"{path}: invalid JSON: {e}") from e
  if isinstance(data, dict):  # {id: row} maps
    data = list(data.values())
  if not isinstance(data, list):
    raise ValueError(f"{path}: expected a JSON list of objects, got {type(data).__name__}")
  for i, row in enumerate(data):
    if not isinstance(row, dict):
      raise ValueError(f"{path}: row {i}: expected a JSON object, got {type(row).__name__} "
                       f"{_short(row)}")
  return data


def read_rows(path: str) -> list[dict[str, Any]]:
  """Rows of a .jsonl / .json (list) / .parquet file, optionally .gz-compressed (json/jsonl);
  local or a URL.

  Raises:
    ValueError: on an unknown extension, an unreadable file (bad JSON on a line, with its line
      number; not parquet; not gzip; not UTF-8), or a row that is not an object.
  """
  name = path[:-3] if path.endswith(".gz") else path
  if not name.endswith((".parquet", ".jsonl", ".json")):
    raise ValueError(f"{path}: unknown file type (expected .jsonl, .json, .parquet; json/jsonl "
                     "may be .gz)")
  if name.endswith(".parquet"):
    try:
      with paths.as_path(path).open("rb") as f:
        return parquet.read_rows(f)
    except parquet.ParquetError as e:
      raise ValueError(f"{path}: not a readable parquet file: {e}") from e
  try:
    with contextlib.ExitStack() as stack:
      raw = stack.enter_context(paths.as_path(path).open("rb"))
      if path.endswith(".gz"):
        raw = stack.enter_context(gzip.open(raw))
      return _json_rows(path, name, stack.enter_context(io.TextIOWrapper(raw, encoding="utf-8")))
  except UnicodeDecodeError as e:
    raise ValueError(f"{path}: not UTF-8 text: {e}") from e
  except gzip.BadGzipFile as e:
    raise ValueError(f"{path}: not a gzip file: {e}") from e


def detect_format(path: str, rows: Sequence[dict[str, Any]]) -> str:
  """Guesses the format of `rows` read from `path` (see module docstring).

  Raises:
    ValueError: when no format fits.
  """
  if not rows:
    raise ValueError(f"{path}: no rows")
  keys = {k for k, v in rows[0].items() if v is not None}  # parquet fills absent columns with null
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


def _row_id(row: Mapping[str, Any], i: int, keys: Iterable[str]) -> str:
  for k in keys:
    if row.get(k) not in (None, ""):
      return str(row[k])
  return str(i)


def _text(value: Any, where: str) -> str:
  """A required text field: a non-empty str, never None nor the text 'None'.

  Args:
    value: the field's value.
    where: names the file, row and field in errors.

  Returns:
    `value`.

  Raises:
    ValueError: naming `where` and the value.
  """
  if value is None:
    raise ValueError(f"{where} is missing or null")
  if not isinstance(value, str):
    raise ValueError(f"{where} must be a string, got {type(value).__name__} {_short(value)}")
  if not value.strip():
    raise ValueError(f"{where} is empty: {value!r}")
  if value.strip() == "None":
    raise ValueError(f"{where} is the string 'None' (a null written out as text upstream?)")
  return value


def _optional_text(row: Mapping[str, Any], key: str, where: str) -> str | None:
  """`row[key]` when it is a non-empty string, None when absent, null or empty; else an error."""
  value = row.get(key)
  if value is None or (isinstance(value, str) and not value.strip()):
    return None
  return _text(value, f"{where}: {key}")


def _first_text(row: Mapping[str, Any], keys: Sequence[str], where: str) -> str:
  """The first of `keys` that is present and not null, as required text."""
  for k in keys:
    if row.get(k) is not None:
      return _text(row[k], f"{where}: {k}")
  raise ValueError(f"{where}: {' or '.join(keys)} is missing or null (row keys "
                   f"{sorted(row)})")


def _answer_str(value: Any, where: str) -> str:
  """One answer as text: a non-empty string or a finite number (never None / 'None' / NaN)."""
  if value is None:
    raise ValueError(f"{where} is missing or null")
  if isinstance(value, bool) or not isinstance(value, (str, int, float)):
    raise ValueError(f"{where} must be a string or a number, got {type(value).__name__} "
                     f"{_short(value)}")
  if isinstance(value, float):
    if not math.isfinite(value):
      raise ValueError(f"{where} must be a finite number, got {value!r}")
    return repr(value)
  if isinstance(value, int):
    return str(value)
  return _text(value, where).strip()


def _math_ground_truth(value: Any, where: str) -> str | list[str]:
  """A math ground truth: one answer, or a non-empty list of acceptable answers."""
  if hasattr(value, "tolist"):  # numpy arrays from pandas-written parquet
    value = value.tolist()
  if isinstance(value, (list, tuple)):
    if not value:
      raise ValueError(f"{where} is an empty list")
    return [_answer_str(v, f"{where}[{j}]") for j, v in enumerate(value)]
  return _answer_str(value, where)


def _decode_tests(tests: Any, where: str) -> list[dict[str, Any]]:
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
                     f"{_short(tests)}")
  for j, t in enumerate(tests):
    if not isinstance(t, dict):
      raise ValueError(f"{where}[{j}] must be an {{input, output}} object, got {_short(t)}")
    for key in ("input", "output"):
      if not isinstance(t.get(key), str):
        raise ValueError(f"{where}[{j}].{key} must be a string, got "
                         f"{type(t.get(key)).__name__} {_short(t.get(key))}")
  return tests


def _verl_prompt(prompt: Any, where: str) -> str | list[dict[str, str]]:
  """A veRL `prompt`: a non-empty string or a chat list of {role, content} strings."""
  if hasattr(prompt, "tolist"):
    prompt = prompt.tolist()
  if not isinstance(prompt, list):
    return _text(prompt, where)
  if not prompt:
    raise ValueError(f"{where} is an empty chat-message list")
  out = []
  for j, m in enumerate(prompt):
    if not isinstance(m, dict):
      raise ValueError(f"{where}[{j}] must be a {{role, content}} object, got {_short(m)}")
    role = _text(m.get("role"), f"{where}[{j}].role")
    content = m.get("content")
    if not isinstance(content, str):
      raise ValueError(f"{where}[{j}].content must be a string, got {type(content).__name__} "
                       f"{_short(content)}")
    out.append({"role": role, "content": content})
  users = [m["content"] for m in out if m["role"] == "user"]
  _text(users[-1] if users else out[-1]["content"], f"{where} (user message content)")
  return out


def _verl_ground_truth(row: Mapping[str, Any], extra: dict[str, Any], where: str):
  """(ground truth, ability) of a veRL row; code ground truths decoded to test lists."""
  rm = row.get("reward_model")
  if not isinstance(rm, dict):
    raise ValueError(f"{where}: reward_model must be an object with ground_truth, got "
                     f"{_short(rm)} (row keys {sorted(row)})")
  gt = rm.get("ground_truth")
  ability = row.get("ability") or extra.get("ability")
  if ability is not None and not isinstance(ability, str):
    raise ValueError(f"{where}: ability must be a string, got {_short(ability)}")
  if ability == "code" or (isinstance(gt, str) and gt.lstrip().startswith("[{")):
    return _decode_tests(gt, f"{where}: reward_model.ground_truth"), "code"
  return _math_ground_truth(gt, f"{where}: reward_model.ground_truth"), ability or "math"


def _load_verl(rows, src, path):
  out = []
  for i, row in enumerate(rows):
    where = f"{path}: row {i}"
    extra = row.get("extra_info")
    if extra is not None and not isinstance(extra, dict):
      raise ValueError(f"{where}: extra_info must be an object, got {_short(extra)}")
    extra = dict(extra or {})
    gt, extra["ability"] = _verl_ground_truth(row, extra, where)
    prompt = _verl_prompt(row.get("prompt"), f"{where}: prompt")
    data_source = _optional_text(row, "data_source", where) or src
    pid = str(extra.get("prompt_id") or _row_id(extra, i, ("id", "index", "idx")))
    if not pid.startswith(f"{data_source}/"):  # a row that `save_prompts` wrote keeps its full id
      pid = f"{data_source}/{pid}"
    out.append(PromptRecord(pid, prompt, gt, data_source, extra))
  return out


def _math_record(src: str, pid: str, problem: str, gt: Any, row: Mapping[str, Any],
                 consumed: tuple[str, ...]) -> PromptRecord:
  """A math benchmark prompt: the paper's math template; the row's other fields kept in ``extra``."""
  extra = {k: v for k, v in row.items() if k not in consumed}
  extra.update(ability="math", problem=problem)
  return PromptRecord(f"{src}/{pid}", templates.chat_messages(templates.math_prompt(problem)), gt,
                      src, extra)


def _load_math(rows, src, path):
  out = []
  for i, row in enumerate(rows):
    where = f"{path}: row {i}"
    problem = _first_text(row, ("problem", "question"), where)
    gt = _answer_str(row.get("answer"), f"{where}: answer")
    pid = _row_id(row, i, ("unique_id", "id", "idx"))
    out.append(_math_record(src, pid, problem, gt, row, ("problem", "question", "answer")))
  return out


def _load_minerva(rows, src, path):
  out = []
  for i, row in enumerate(rows):
    where = f"{path}: row {i}"
    problem = _first_text(row, ("problem", "question"), where)
    if row.get("answer") not in (None, ""):
      gt = _answer_str(row["answer"], f"{where}: answer")
    else:
      solution = _text(row.get("solution"), f"{where}: solution (no answer field)")
      gt = math_answer.extract_boxed(solution)
      if not gt:
        raise ValueError(f"{where}: no answer field and no \\boxed{{}} in the solution")
    pid = _row_id(row, i, ("idx", "id", "unique_id"))
    out.append(_math_record(src, pid, problem, gt, row, ("problem", "question", "answer")))
  return out


def _load_olympiadbench(rows, src, path):
  out = []
  for i, row in enumerate(rows):
    where = f"{path}: row {i}"
    question = _first_text(row, ("question", "problem"), where)
    fa = row.get("final_answer")
    if hasattr(fa, "tolist"):
      fa = fa.tolist()
    if fa is None:
      raise ValueError(f"{where}: final_answer is missing or null")
    answers = fa if isinstance(fa, list) else [fa]
    gt = [a.strip().strip("$").strip() if isinstance(a, str)
          else _answer_str(a, f"{where}: final_answer[{j}]") for j, a in enumerate(answers)]
    gt = [a for a in gt if a]
    if not gt:
      raise ValueError(f"{where}: empty final_answer {fa!r}")
    for j, a in enumerate(gt):
      _text(a, f"{where}: final_answer[{j}]")
    context = _optional_text(row, "context", where)
    problem = question if not context else f"{context}\n\n{question}"
    pid = _row_id(row, i, ("id", "idx", "unique_id"))
    out.append(_math_record(src, pid, problem, gt, row, ("question", "final_answer")))
  return out


def _load_humanevalplus(rows, src, path):
  out = []
  for i, row in enumerate(rows):
    where = f"{path}: row {i}"
    for key in ("task_id", "prompt", "entry_point", "canonical_solution"):
      _text(row.get(key), f"{where}: {key}")
    for key in ("base_input", "plus_input"):
      if key in row and row[key] is None:
        raise ValueError(f"{where}: {key} is null")
    extra = {"ability": "code", "task_id": row["task_id"], "entry_point": row["entry_point"]}
    out.append(PromptRecord(row["task_id"],
                            templates.chat_messages(templates.humaneval_prompt(row["prompt"])),
                            dict(row), src, extra))
  return out


def _code_metadata(row: Mapping[str, Any], where: str) -> dict[str, Any]:
  meta = row.get("metadata")
  if isinstance(meta, str):
    try:
      meta = json.loads(meta) if meta.strip() else {}
    except json.JSONDecodeError as e:
      raise ValueError(f"{where}: metadata is a string but not JSON: {e}") from e
  return meta if isinstance(meta, dict) else {}


def _load_rllm_code(rows, src, path):
  out = []
  for i, row in enumerate(rows):
    where = f"{path}: row {i}"
    problem = _first_text(row, ("problem", "question"), where)
    tests = _decode_tests(row.get("tests"), f"{where}: tests")
    kinds = {t.get("testtype", "stdin") for t in tests}
    if kinds - {"stdin", "functional"} or len(kinds) > 1:
      raise ValueError(f"{where}: tests must be all 'stdin' or all 'functional', got test types "
                       f"{sorted(map(str, kinds))}")
    meta = _code_metadata(row, where)
    pid = _row_id({**meta, **row}, i, ("id", "problem_id", "question_id", "idx"))
    extra = {k: v for k, v in row.items() if k not in ("problem", "question", "tests")}
    extra.update(ability="code", problem=problem)
    if kinds == {"functional"}:
      extra["func_name"] = _text(meta.get("func_name"),
                                 f"{where}: metadata.func_name (functional tests need it)")
    starter = _optional_text(row, "starter_code", where)
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
    limit: keep only the first `limit` rows (>= 1; None: all).

  Returns:
    The records, in file order (never empty).

  Raises:
    ValueError: on an unknown format, an empty file, or a malformed row (the message names the
      file, the row (0-based), the field and its value).
  """
  fmt = BENCHMARK_FORMATS.get(fmt, fmt)
  if fmt != "auto" and fmt not in FORMATS:
    raise ValueError(f"fmt must be 'auto', one of {FORMATS} or a benchmark of "
                     f"{sorted(BENCHMARK_FORMATS)}, got {fmt!r}")
  if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
    raise ValueError(f"limit must be an int >= 1 or None, got {limit!r}")
  rows = read_rows(path)
  if not rows:
    raise ValueError(f"{path}: the file has no rows")
  if limit is not None:
    rows = rows[:limit]
  return records_from_rows(rows, fmt, where=path, data_source=data_source or _source_name(path))


def records_from_rows(rows: Sequence[dict[str, Any]], fmt: str, *, where: str,
                      data_source: str) -> list[PromptRecord]:
  """`PromptRecord`s of rows already read (a file's, or a Hugging Face dataset's).

  Args:
    rows: the rows (non-empty).
    fmt: 'auto' or one of `FORMATS` (benchmark names already mapped).
    where: what the rows come from, for messages (a path, a dataset name).
    data_source: the records' data source (veRL rows keep theirs).

  Raises:
    ValueError: on a malformed row (naming ``where``, the row, the field and its value) or a
      duplicate prompt id.
  """
  if fmt == "auto":
    fmt = detect_format(where, rows)
  records = _LOADERS[fmt](rows, data_source, where)
  seen = set()
  for r in records:
    if r.prompt_id in seen:
      raise ValueError(f"{where}: duplicate prompt_id {r.prompt_id!r}")
    seen.add(r.prompt_id)
  return records


def save_prompts(records: Sequence[PromptRecord], path: str) -> None:
  """Writes records as veRL rows (`.jsonl` or `.parquet`).

  Raises:
    ValueError: on another extension.
  """
  rows = [r.to_verl_row() for r in records]
  if path.endswith(".parquet"):
    with paths.as_path(path).open("wb") as f:
      parquet.write_rows(rows, f)
  elif path.endswith(".jsonl"):
    with paths.as_path(path).open("w", encoding="utf-8") as f:
      for row in rows:
        f.write(json.dumps(row) + "\n")
  else:
    raise ValueError(f"save_prompts: path must end in .jsonl or .parquet, got {path!r}")
