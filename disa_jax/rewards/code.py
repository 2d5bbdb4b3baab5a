"""Code reward: run candidate programs against tests in the sandbox of `disa_jax.rewards.sandbox`.

Two test styles:

- stdin/stdout cases (CodeForces, LiveCodeBench in the rllm `{problem, tests: [{input, output}]}`
  format): `run_stdio(program, cases, timeout_s) -> list[bool]`. One sandbox per candidate; each
  case is a fresh process with the case's input on stdin; outputs are compared by the grader
  (`stdio_output_matches`), so expected outputs never enter the sandbox. LiveCodeBench's
  functional (LeetCode-style) tests go through `run_functional(program, cases, func_name)`.
- function calls (HumanEval+): `run_humaneval(problem, completion, timeout_s) -> bool`. The
  candidate's entry point is called on every `base_input` and `plus_input` inside one sandboxed
  process; its return values come back JSON-encoded and are compared outside the sandbox against the
  canonical solution's outputs (computed once in the sandbox, cached in memory and on disk) with the
  problem's `atol` (EvalPlus rules); the original HumanEval `check(candidate)` must pass too.

`extract_code(response)` takes the last fenced code block of a model response.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import re
import threading
from typing import Any, Mapping, Sequence

import numpy as np

from disa_jax.rewards import sandbox

__all__ = [
  "extract_code",
  "stdio_output_matches",
  "run_stdio",
  "run_functional",
  "functional_output_matches",
  "run_humaneval",
  "humaneval_program",
  "humaneval_expected_outputs",
  "humaneval_outputs_match",
  "decode_value",
]

_HERE = os.path.dirname(os.path.abspath(__file__))
_FENCE_TAG_RE = re.compile(r"[ \t]*([A-Za-z0-9_+-]*)")


def _fenced_blocks(response: str) -> list[tuple[str, str]]:
  """Every fenced block, left to right, as (tag, code); linear time.

  A block opens with ```` ``` ```` and the rest of that line (a tag of letters, digits, `_+-` after
  optional blanks, then anything), holds the following lines, and closes at the next
  ```` ``` ````. Blocks do not overlap.
  """
  blocks = []
  pos = 0
  while True:
    start = response.find("```", pos)
    if start < 0:
      return blocks
    line_end = response.find("\n", start + 3)
    close = response.find("```", line_end + 1) if line_end >= 0 else -1
    if close < 0:  # no later fence can complete either
      return blocks
    tag = _FENCE_TAG_RE.match(response, start + 3, line_end).group(1)
    blocks.append((tag, response[line_end + 1:close]))
    pos = close + 3


def extract_code(response: str, language: str = "python") -> str:
  """The last fenced code block of `response` (preferring blocks tagged `language`).

  Linear time in the response's length (it runs in the grader, on untrusted model output).

  Args:
    response: the model output.
    language: preferred fence tag (case-insensitive); untagged blocks are also accepted.

  Returns:
    The code; the whole response when there is no fenced block.
  """
  blocks = _fenced_blocks(response)
  if not blocks:
    return response
  tagged = [code for tag, code in blocks if tag.lower() in (language.lower(), "py", "python3")]
  untagged = [code for tag, code in blocks if not tag]
  pick = tagged or untagged or [code for _, code in blocks]
  return pick[-1]


# ----------------------------------------------------------------------------------------------
# stdin/stdout.
# ----------------------------------------------------------------------------------------------

_FLOAT_RE = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?")


def _token_match(actual: str, expected: str, tol: float) -> bool:
  if actual == expected:
    return True
  # Floating-point tokens: only when the expected token is written as a non-integer.
  if ("." in expected or "e" in expected.lower()) and _FLOAT_RE.fullmatch(expected) and \
      _FLOAT_RE.fullmatch(actual):
    a, e = float(actual), float(expected)
    return math.isfinite(a) and abs(a - e) <= tol * max(1.0, abs(e))
  return False


_TOKEN_RE = re.compile(r"\S+")
_BLANK_RE = re.compile(r"\s*")


def _blank(text: str, start: int, end: int) -> bool:
  """Whether text[start:end] is all whitespace (without copying it)."""
  return _BLANK_RE.match(text, start, end).end() == end


def _lines_match(actual: str, expected: str) -> bool:
  """Line-by-line equality after `rstrip`, trailing empty lines dropped, scanning `actual` in place
  (none of its lines is copied or listed: a flood costs no memory beyond its string)."""
  want = [l.rstrip() for l in expected.split("\n")]
  while want and not want[-1]:
    want.pop()
  i = pos = 0
  while pos <= len(actual):
    end = actual.find("\n", pos)
    end = len(actual) if end < 0 else end
    if i < len(want):
      if not (actual.startswith(want[i], pos, end) and _blank(actual, pos + len(want[i]), end)):
        return False
      i += 1
    elif not _blank(actual, pos, end):
      return False
    pos = end + 1
  return i == len(want)


def stdio_output_matches(actual: str, expected: str, *, float_tol: float = 1e-6) -> bool:
  """Whether a program's stdout matches the expected output.

  Lines are compared after stripping trailing whitespace (a trailing CR included) and dropping
  trailing empty lines; if that fails, whitespace-separated tokens are compared, with a
  relative/absolute tolerance `float_tol` for tokens whose expected form is a decimal (`0.5`,
  `1e-3`). Integers must match exactly. `actual` is scanned lazily: only the expected output is
  split into lists, so a flood of short lines or tokens costs no memory beyond its string.

  Args:
    actual: the program's stdout.
    expected: the reference output.
    float_tol: tolerance for decimal tokens.

  Returns:
    True when they match.
  """
  if _lines_match(actual, expected):
    return True
  tokens = _TOKEN_RE.finditer(actual)
  for e in expected.split():
    a = next(tokens, None)
    if a is None or not _token_match(a.group(), e, float_tol):
      return False
  return next(tokens, None) is None


def _default_limits(timeout_s: float) -> sandbox.SandboxLimits:
  return sandbox.SandboxLimits(cpu_s=max(1, int(math.ceil(timeout_s)) + 1))


def run_stdio(program: str, cases: Sequence[Mapping[str, str]], timeout_s: float = 6.0, *,
              limits: sandbox.SandboxLimits | None = None, stop_on_timeout: bool = True
              ) -> list[bool]:
  """Runs `program` on every case's stdin and checks its stdout.

  Args:
    program: Python source (already extracted from the response).
    cases: `[{"input": str, "output": str}, ...]`.
    timeout_s: wall-clock bound per case.
    limits: sandbox rlimits (default: CPU = timeout + 1 s, 2 GiB, 16 MiB output, 32 processes).
    stop_on_timeout: after a timeout, report the remaining cases as failed without running them.

  Returns:
    One bool per case.

  Raises:
    ValueError: when a case lacks `input` or `output`.
  """
  for i, c in enumerate(cases):
    if "input" not in c or "output" not in c:
      raise ValueError(f"cases[{i}] must have 'input' and 'output' keys, got {sorted(c)}")
  if not cases:
    return []
  res = sandbox.run_cases({"main.py": program}, "main.py",
                          [str(c["input"]).encode() for c in cases], timeout_s=timeout_s,
                          limits=limits or _default_limits(timeout_s),
                          stop_on_timeout=stop_on_timeout)
  return [r.ok and stdio_output_matches(r.stdout.decode(errors="replace"), str(c["output"]))
          for r, c in zip(res, cases)]


_FUNCTIONAL_DRIVER = """\
import json, os, sys
out_fd = os.dup(1)
os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
ns = {"__name__": "__candidate__"}
exec(compile(open("candidate.py").read(), "candidate.py", "exec"), ns)
name = %s
fn = getattr(ns["Solution"](), name) if "Solution" in ns else ns[name]
args = [json.loads(line) for line in sys.stdin.read().splitlines() if line.strip()]
os.write(out_fd, json.dumps(fn(*args)).encode())
"""


def functional_output_matches(actual: str, expected: str) -> bool:
  """LiveCodeBench functional check: the JSON values are equal (tuples read as lists)."""
  try:
    return json.loads(actual) == json.loads(expected)
  except (ValueError, RecursionError):
    return False


def run_functional(program: str, cases: Sequence[Mapping[str, str]], func_name: str,
                   timeout_s: float = 6.0, *, limits: sandbox.SandboxLimits | None = None
                   ) -> list[bool]:
  """Runs LiveCodeBench functional (LeetCode-style) tests.

  Calls `Solution().<func_name>` (or a top-level `<func_name>`) with the JSON values on the lines of
  each case's input and compares the JSON of the return value with the case's output. The call runs
  in the sandbox (one process per case); the comparison runs in the grader.

  Args:
    program: the candidate's code (defines `class Solution` or the function).
    cases: `[{"input": "<json>\\n<json>...", "output": "<json>"}, ...]`.
    func_name: the method / function name (LiveCodeBench `metadata.func_name`).
    timeout_s: wall-clock bound per case.
    limits: sandbox rlimits.

  Returns:
    One bool per case.
  """
  if not isinstance(func_name, str) or not func_name.isidentifier():
    raise ValueError(f"func_name must be a Python identifier, got {func_name!r}")
  for i, c in enumerate(cases):
    if "input" not in c or "output" not in c:
      raise ValueError(f"cases[{i}] must have 'input' and 'output' keys, got {sorted(c)}")
  if not cases:
    return []
  files = {"main.py": _FUNCTIONAL_DRIVER % json.dumps(func_name), "candidate.py": program}
  res = sandbox.run_cases(files, "main.py", [str(c["input"]).encode() for c in cases],
                          timeout_s=timeout_s, limits=limits or _default_limits(timeout_s))
  return [r.ok and functional_output_matches(r.stdout.decode(errors="replace"), str(c["output"]))
          for r, c in zip(res, cases)]


# ----------------------------------------------------------------------------------------------
# HumanEval+ function calls.
# ----------------------------------------------------------------------------------------------


def decode_value(x: Any) -> Any:
  """Inverse of the runner's `encode` (see `_humaneval_runner`); never executes anything.

  Raises:
    ValueError: on a malformed value.
  """
  if isinstance(x, list):
    if not any(isinstance(v, (list, dict)) for v in x):  # fast path: plain scalars
      return x
    return [decode_value(v) for v in x]
  if isinstance(x, dict):
    tag, v = x.get("__t"), x.get("v")
    if tag == "tuple":
      return tuple(decode_value(i) for i in v)
    if tag == "set":
      return {decode_value(i) for i in v}
    if tag == "frozenset":
      return frozenset(decode_value(i) for i in v)
    if tag == "dict":
      return {decode_value(k): decode_value(val) for k, val in v}
    if tag == "bytes":
      return bytes.fromhex(v)
    if tag == "complex":
      return complex(decode_value(v[0]), decode_value(v[1]))
    if tag == "float":
      return float(v)
    if tag == "bigint":
      return int(v, 16)
    if tag == "repr":
      return ("__repr__", str(v))
    raise ValueError(f"decode_value: unknown tag {tag!r}")
  return x


def _is_floats(x: Any) -> bool:
  if isinstance(x, float):
    return True
  if isinstance(x, (list, tuple)) and x:
    return all(isinstance(i, float) for i in x)
  return False


def _poly(xs: Sequence[float], x: float) -> float:
  return sum(c * x ** i for i, c in enumerate(xs))


def humaneval_outputs_match(out: Any, exp: Any, atol: float, *, entry_point: str = "",
                            args: Sequence[Any] = ()) -> bool:
  """EvalPlus comparison of one output (decoded values).

  Exact equality; otherwise, when `atol` != 0 (or the expected value is a float / list of floats,
  which forces atol = 1e-6), same type, same length and `np.allclose(out, exp, rtol=1e-7, atol)`.
  `find_zero` (HumanEval/32) is checked by its oracle `|poly(xs, out)| <= atol` instead.

  Args:
    out: the candidate's return value.
    exp: the canonical solution's return value.
    atol: the problem's absolute tolerance.
    entry_point: the function name (selects special oracles).
    args: the call's arguments (used by oracles).

  Returns:
    True when the output is accepted.
  """
  try:
    if entry_point == "find_zero":
      return isinstance(out, (int, float)) and not isinstance(out, bool) and \
          abs(_poly(args[0], out)) <= atol
    exact = out == exp
    if isinstance(exact, bool) and exact:
      return True
    if atol == 0 and _is_floats(exp):
      atol = 1e-6
    if atol == 0:
      return False
    if type(out) != type(exp):  # pylint: disable=unidiomatic-typecheck
      return False
    if isinstance(exp, (list, tuple)) and len(out) != len(exp):
      return False
    return bool(np.allclose(out, exp, rtol=1e-7, atol=atol))
  except (TypeError, ValueError, OverflowError, IndexError, ZeroDivisionError):
    return False


def humaneval_program(problem: Mapping[str, Any], completion: str) -> str:
  """The program to run: the prompt followed by the completion.

  A completion that is a function body continues the prompt's function; one that redefines the entry
  point overrides the prompt's docstring-only definition.
  """
  return problem["prompt"] + "\n" + completion + "\n"


@functools.lru_cache(maxsize=512)
def _inputs_json(base_input: str, plus_input: str) -> str:
  base = json.loads(base_input) if isinstance(base_input, str) else base_input
  plus = json.loads(plus_input) if isinstance(plus_input, str) else plus_input
  return json.dumps(list(base) + list(plus))


def _inputs(problem: Mapping[str, Any]) -> str:
  base, plus = problem.get("base_input", "[]"), problem.get("plus_input", "[]")
  if not isinstance(base, str):
    base = json.dumps(base)
  if not isinstance(plus, str):
    plus = json.dumps(plus)
  return _inputs_json(base, plus)


# Output caps of the HumanEval+ runner's JSON: the canonical solution's (HumanEval/15's outputs on
# its plus inputs are 141 MiB of JSON), and a candidate's: 8x the canonical outputs' JSON (a matching
# float's repr can be ~5x longer) plus 1 MiB, at most the canonical cap.
_CANONICAL_OUTPUT_MB = 256
_MIB = 1 << 20


def _candidate_output_mb(expected: list) -> int:
  return min(_CANONICAL_OUTPUT_MB, 1 + 8 * len(json.dumps(expected)) // _MIB)


def _run_function_calls(problem: Mapping[str, Any], program: str, inputs_json: str,
                        timeout_s: float, with_check: bool, limits: sandbox.SandboxLimits | None,
                        output_mb: int) -> dict[str, Any] | None:
  """Runs the runner in the sandbox; returns its JSON document or None on any failure.

  At most `output_mb` MiB of it are written and read (`limits.output_cap_bytes` when given), and
  one that reaches the cap (maybe cut short) fails unparsed: the grader's memory grows with the
  cap, never with the candidate's output."""
  with open(os.path.join(_HERE, "_humaneval_runner.py")) as f:
    runner = f.read()
  payload = ('{"program": ' + json.dumps(program) + ', "entry_point": ' +
             json.dumps(problem["entry_point"]) + ', "inputs": ' + inputs_json + ', "test": ' +
             json.dumps(problem.get("test") if with_check else None) + "}")
  lim = limits or sandbox.SandboxLimits(cpu_s=max(1, int(math.ceil(timeout_s)) + 1),
                                        fsize_mb=output_mb, output_cap_bytes=output_mb * _MIB)
  res = sandbox.run_cases({"runner.py": runner, "payload.json": payload}, "runner.py", [None],
                          timeout_s=timeout_s, limits=lim)[0]
  if not res.ok or len(res.stdout) >= lim.output_cap_bytes:
    return None
  try:
    doc = json.loads(res.stdout)
  except (ValueError, RecursionError):
    return None
  if not isinstance(doc, dict) or not isinstance(doc.get("results"), list):
    return None
  return doc


_EXPECTED_MEM: dict[str, list] = {}
_EXPECTED_LOCK = threading.Lock()


def _cache_dir() -> str:
  return os.environ.get("DISA_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache",
                                                       "disa_jax"))


def humaneval_expected_outputs(problem: Mapping[str, Any], *, timeout_s: float = 120.0,
                               use_disk_cache: bool = True) -> list:
  """Encoded outputs of the canonical solution on base + plus inputs (sandboxed, cached).

  Args:
    problem: a HumanEval+ record (prompt, canonical_solution, entry_point, base_input, plus_input).
    timeout_s: bound for running the canonical solution.
    use_disk_cache: read/write `$DISA_CACHE_DIR/humaneval_expected/<sha256>.json`
      (default `~/.cache/disa_jax`).

  Returns:
    The runner's `results` list (`["ok", value]` / `["err", type]` per input).

  Raises:
    RuntimeError: when the canonical solution does not run in the sandbox.
  """
  inputs_json = _inputs(problem)
  program = humaneval_program(problem, problem["canonical_solution"])
  key = hashlib.sha256((program + "\0" + problem["entry_point"] + "\0" + inputs_json).encode()
                       ).hexdigest()
  with _EXPECTED_LOCK:
    if key in _EXPECTED_MEM:
      return _EXPECTED_MEM[key]
  path = os.path.join(_cache_dir(), "humaneval_expected", key + ".json")
  if use_disk_cache and os.path.exists(path):
    try:
      with open(path) as f:
        results = json.load(f)
      with _EXPECTED_LOCK:
        _EXPECTED_MEM[key] = results
      return results
    except (OSError, ValueError):
      pass
  doc = _run_function_calls(problem, program, inputs_json, timeout_s, False, None,
                            _CANONICAL_OUTPUT_MB)
  if doc is None or doc.get("load_error"):
    raise RuntimeError(f"{problem.get('task_id', '?')}: the canonical solution failed in the "
                       f"sandbox (or its outputs reached {_CANONICAL_OUTPUT_MB} MiB of JSON): "
                       f"{None if doc is None else doc.get('load_error')}")
  results = doc["results"]
  if use_disk_cache:
    try:
      os.makedirs(os.path.dirname(path), exist_ok=True)
      tmp = f"{path}.{os.getpid()}.tmp"
      with open(tmp, "w") as f:
        json.dump(results, f)
      os.replace(tmp, path)
    except OSError:
      pass
  with _EXPECTED_LOCK:
    _EXPECTED_MEM[key] = results
  return results


def run_humaneval(problem: Mapping[str, Any], completion: str, timeout_s: float = 30.0, *,
                  run_check: bool = True, limits: sandbox.SandboxLimits | None = None) -> bool:
  """Whether `completion` solves a HumanEval+ problem on all base and plus inputs.

  Args:
    problem: a HumanEval+ record (task_id, prompt, entry_point, canonical_solution, base_input,
      plus_input, atol, test).
    completion: the function body or a full definition of the entry point (code only; use
      `extract_code` on a raw response first).
    timeout_s: wall-clock bound for running all inputs (one sandboxed process).
    run_check: also require the original HumanEval `check(candidate)` to pass.
    limits: sandbox rlimits (default: CPU = timeout + 1 s, other limits as `SandboxLimits`, and
      the candidate's output capped at 8x the canonical outputs' JSON + 1 MiB).

  Returns:
    True when every output matches and (if `run_check`) the check passes.
  """
  for key in ("prompt", "entry_point", "canonical_solution"):
    if key not in problem:
      raise ValueError(f"problem is missing field {key!r} (has {sorted(problem)})")
  expected = humaneval_expected_outputs(problem)
  inputs_json = _inputs(problem)
  doc = _run_function_calls(problem, humaneval_program(problem, completion), inputs_json,
                            timeout_s, run_check and bool(problem.get("test")), limits,
                            _candidate_output_mb(expected))
  if doc is None or doc.get("load_error"):
    return False
  results = doc["results"]
  if len(results) != len(expected):
    return False
  if run_check and problem.get("test") and doc.get("check") is not True:
    return False
  atol = float(problem.get("atol", 0) or 0)
  entry = problem["entry_point"]
  inputs = json.loads(inputs_json) if entry == "find_zero" else None
  try:
    for i, (got, exp) in enumerate(zip(results, expected)):
      if not isinstance(got, list) or len(got) != 2:
        return False
      if exp[0] == "err" or got[0] == "err":
        if got[0] != exp[0]:
          return False
        continue
      if not humaneval_outputs_match(decode_value(got[1]), decode_value(exp[1]), atol,
                                     entry_point=entry,
                                     args=inputs[i] if inputs is not None else ()):
        return False
  except (ValueError, TypeError, RecursionError):
    return False
  return True
