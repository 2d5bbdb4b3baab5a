"""Acceptance of the verifiers on the real benchmark files (issue 4, item 7).

Prints, for the files under `<repo>/../shared/data/benchmarks`:

1. MATH-500: the reference solutions' boxed answers graded against the `answer` field (ours vs raw
   math-verify), and false-accept counts for (a) one-digit mutations of every answer and (b) the
   reference solution of a different problem.
2. AIME 2024/2025 and AMC 2023 (every copy): each ground truth written the ways models write it
   (plain, zero-padded, trailing unit, degree sign, e-notation, "final answer is" sentence, list of
   acceptable answers) -> acceptance rate of ours vs raw math-verify; and mutated answers
   (+1 on the value) in the same styles -> false accepts (must be 0).
3. HumanEval+: canonical solutions on base + plus inputs (must be >= 99%), and up to three mutants
   per problem (first integer literal +1, first comparison flipped, a wrong output on the last plus
   input only) -> how many are caught; mutants that survive are listed (equivalent mutants).

Usage: python benchmarks/bench_rewards_acceptance.py [--skip-code] [--limit-code N]
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import os
import pathlib
import re
import sys
import time
import tokenize

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
SHARED = (REPO / ".." / "shared" / "data" / "benchmarks").resolve()

from disa_jax.tasks.prompts import load_prompts  # noqa: E402
from disa_jax.rewards import code  # noqa: E402
from disa_jax.rewards import math_verify_grader as mvg  # noqa: E402


def _mutate_digit(answer: str) -> str | None:
  m = re.search(r"\d", answer)
  if not m:
    return None
  return answer[:m.start()] + str((int(m.group()) + 1) % 10) + answer[m.end():]


def math500() -> None:
  rows = [json.loads(l) for l in open(SHARED / "math500" / "math500_simplerl.jsonl")]
  ours = raw = 0
  misgraded = []
  for r in rows:
    o, w = mvg.grade(r["solution"], r["answer"]), mvg.grade_raw(r["solution"], r["answer"])
    ours += o
    raw += w
    if not o:
      misgraded.append((r["unique_id"], r["answer"]))
  print(f"MATH-500 reference solutions accepted: ours {ours}/{len(rows)} "
        f"({100 * ours / len(rows):.1f}%), raw math-verify {raw}/{len(rows)}")
  for m in misgraded:
    print("  not accepted:", m)
  fa_ours = fa_raw = n = 0
  for r in rows:
    mut = _mutate_digit(r["answer"])
    if mut is None:
      continue
    n += 1
    resp = f"Therefore the answer is $\\boxed{{{mut}}}$."
    if mvg.grade(resp, r["answer"]):
      fa_ours += 1
      print("  FALSE ACCEPT (ours):", r["answer"], "<-", mut)
    fa_raw += mvg.grade_raw(resp, r["answer"])
  print(f"MATH-500 one-digit mutations falsely accepted: ours {fa_ours}/{n}, raw {fa_raw}/{n}")
  cross = fa = 0
  for i, r in enumerate(rows):
    other = rows[(i + 7) % len(rows)]
    if other["answer"].strip() == r["answer"].strip():
      continue
    cross += 1
    if mvg.grade(other["solution"], r["answer"]):
      fa += 1
      print("  cross accept:", r["answer"], "<-", other["answer"])
  print(f"MATH-500 another problem's solution accepted: {fa}/{cross}")


def _styles(gt: str) -> dict[str, str]:
  """Ways models write the answer `gt` (an integer-valued AIME/AMC answer)."""
  v = float(re.sub(r"\^\\circ|\^\{\\circ\}", "", gt))
  iv = int(v) if v == int(v) else None
  num = str(iv) if iv is not None else repr(v)
  s = {
    "plain": f"\\boxed{{{num}}}",
    "zero_padded": f"\\boxed{{{iv:03d}}}" if iv is not None and 0 <= iv < 1000 else None,
    "unit": f"\\boxed{{{num} \\text{{ units}}}}",
    "degrees": f"\\boxed{{{num}^\\circ}}",
    "e_notation": f"\\boxed{{{num}e0}}",
    "final_answer_is": f"The final answer is ${num}$. I hope it is correct.",
    "answer_line": f"Reasoning...\n**Answer:** {num}\n",
  }
  return {k: v for k, v in s.items() if v is not None}


def aime_amc() -> None:
  files = [SHARED / "aime24" / "aime24_qwen25math.jsonl", SHARED / "aime24" / "aime24_rllm.json",
           SHARED / "aime25" / "aime25_areal.jsonl",
           SHARED / "aime25" / "aime25_skywork_or1.parquet",
           SHARED / "amc23" / "amc23_qwen25math.jsonl",
           SHARED / "amc23" / "amc_2022_2023_rllm.json"]
  for path in files:
    recs = load_prompts(str(path))
    acc_o, acc_r, tot = {}, {}, {}
    false_o = false_r = n_false = 0
    for rec in recs:
      gt = rec.ground_truth
      for style, resp in _styles(gt).items():
        tot[style] = tot.get(style, 0) + 1
        acc_o[style] = acc_o.get(style, 0) + mvg.grade(resp, gt)
        acc_r[style] = acc_r.get(style, 0) + mvg.grade_raw(resp, gt)
      wrong = str(int(float(re.sub(r"\^\\circ", "", gt))) + 1)
      for style, resp in _styles(wrong).items():
        n_false += 1
        if mvg.grade(resp, gt):
          false_o += 1
          print("  FALSE ACCEPT (ours):", path.name, gt, "<-", resp)
        false_r += mvg.grade_raw(resp, gt)
    line = ", ".join(f"{s} {acc_o[s]}/{acc_r[s]}/{tot[s]}" for s in tot)
    total_o, total_r, total = sum(acc_o.values()), sum(acc_r.values()), sum(tot.values())
    print(f"{path.name}: accepted ours/raw/total: {line}; all {total_o}/{total_r}/{total} "
          f"(gain {total_o - total_r}); wrong answers accepted ours {false_o}/{n_false}, "
          f"raw {false_r}/{n_false}")


_PERTURB = """

_mutant_calls = [0]
_mutant_orig = {entry}


def {entry}(*args, **kwargs):
    _mutant_calls[0] += 1
    v = _mutant_orig(*args, **kwargs)
    if _mutant_calls[0] != {n}:
        return v
    if isinstance(v, bool):
        return not v
    if isinstance(v, (int, float)):
        return v + 1
    if isinstance(v, str):
        return v + "x"
    if isinstance(v, list):
        return v + [None]
    if isinstance(v, tuple):
        return v + (None,)
    return 0 if v is None else None
"""


def _mutants(problem: dict) -> dict[str, str]:
  """Mutants of the canonical solution (single-token edits, and a wrong last output)."""
  src = problem["canonical_solution"]
  toks = list(tokenize.generate_tokens(io.StringIO(src).readline))
  lines = src.splitlines(keepends=True)
  out = {}

  def replace(t, new):
    (r0, c0), (_, c1) = t.start, t.end
    edited = list(lines)
    edited[r0 - 1] = edited[r0 - 1][:c0] + new + edited[r0 - 1][c1:]
    return "".join(edited)

  flips = {"<": ">=", ">": "<=", "<=": ">", ">=": "<", "==": "!=", "!=": "=="}
  for t in toks:
    if t.type == tokenize.NUMBER and "int_plus_1" not in out and re.fullmatch(r"\d+", t.string):
      out["int_plus_1"] = replace(t, str(int(t.string) + 1))
    if t.type == tokenize.OP and t.string in flips and "cmp_flip" not in out:
      out["cmp_flip"] = replace(t, flips[t.string])
  n_inputs = len(problem["base_input"]) + len(problem["plus_input"])
  out["last_output_wrong"] = src + _PERTURB.format(entry=problem["entry_point"], n=n_inputs)
  return out


def humanevalplus(limit: int | None) -> None:
  path = SHARED / "humanevalplus" / "HumanEvalPlus-v0.1.10.jsonl.gz"
  rows = [json.loads(l) for l in gzip.open(path, "rt")]
  rows = rows[:limit] if limit else rows
  t0 = time.perf_counter()
  failed = []
  for r in rows:
    try:
      code.humaneval_expected_outputs(r)
    except RuntimeError as e:
      failed.append((r["task_id"], str(e)))
  t1 = time.perf_counter()
  passed = 0
  for r in rows:
    if code.run_humaneval(r, r["canonical_solution"]):
      passed += 1
    else:
      failed.append((r["task_id"], "canonical solution did not pass"))
  t2 = time.perf_counter()
  print(f"HumanEval+ canonical solutions passing base+plus inputs: {passed}/{len(rows)} "
        f"({100 * passed / len(rows):.1f}%)  [expected outputs {t1 - t0:.0f} s, "
        f"grading {t2 - t1:.0f} s]")
  for f in failed:
    print("  ", f)
  caught = total = 0
  survivors = []
  for r in rows:
    for kind, mut in _mutants(r).items():
      total += 1
      if code.run_humaneval(r, mut, timeout_s=20.0):
        survivors.append((r["task_id"], kind))
      else:
        caught += 1
  print(f"HumanEval+ mutants rejected: {caught}/{total}; surviving (equivalent or undetected) "
        f"mutants: {survivors}")


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--skip-code", action="store_true")
  parser.add_argument("--limit-code", type=int, default=None)
  args = parser.parse_args()
  if not SHARED.is_dir():
    sys.exit(f"{SHARED} not found: the real benchmark files are needed")
  math500()
  aime_amc()
  if not args.skip_code:
    humanevalplus(args.limit_code)


if __name__ == "__main__":
  main()
