"""Reward throughput (issue 4, item 8): math grades/s, HumanEval+ executions/s, sandbox overhead.

Repetitions alternate the measured configuration and its peer in the same run (the machine is
shared); every figure is the median over repetitions with [min-max].

1. Math: MATH-500 reference solutions graded by the 2-worker pool, by a 1-worker pool, and by plain
   in-process math-verify in a fresh interpreter (the peer: no isolation, no time bound).
2. Code: HumanEval+ canonical solutions on base + plus inputs (expected outputs cached beforehand),
   one sandbox per problem, sequentially and with 2 concurrent sandboxes.
3. Sandbox overhead: one trivial program run in the sandbox (namespaces, uid switch, mounts,
   rlimits) vs a bare `subprocess.run(python -I prog.py)`; and the cost of one more stdio case
   inside an existing sandbox.

Usage: python benchmarks/bench_rewards_throughput.py [--reps 3] [--code-problems 40]
Needs `<repo>/../shared/data/benchmarks` for items 1-2 (item 3 runs anywhere).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import gzip
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
SHARED = (REPO / ".." / "shared" / "data" / "benchmarks").resolve()

from disa_jax.rewards import code  # noqa: E402
from disa_jax.rewards import math_pool  # noqa: E402
from disa_jax.rewards import math_verify_grader as mvg  # noqa: E402
from disa_jax.rewards import sandbox  # noqa: E402


def _fmt(xs: list[float], unit: str) -> str:
  return f"{statistics.median(xs):.1f} {unit} [{min(xs):.1f}-{max(xs):.1f}]"


_INPROC = """
import json, sys, time
sys.path.insert(0, {repo!r})
from disa_jax.rewards import math_verify_grader as mvg
rows = [json.loads(l) for l in open({path!r})]
mvg.grade("\\\\boxed{{1}}", "1")  # imports and first parse excluded, as for the pool
t0 = time.perf_counter()
n = sum(mvg.grade(r["solution"], r["answer"]) for r in rows)
print(len(rows) / (time.perf_counter() - t0), n)
"""


def bench_math(reps: int) -> None:
  path = SHARED / "math500" / "math500_simplerl.jsonl"
  rows = [json.loads(l) for l in open(path)]
  responses = [r["solution"] for r in rows]
  gts = [r["answer"] for r in rows]
  rates: dict[str, list[float]] = {"pool2": [], "pool1": [], "inproc": []}
  for _ in range(reps):
    for workers in (2, 1):
      # A fresh pool per rep: cold parse caches in the workers, like the in-process peer.
      with math_pool.MathGraderPool(workers) as pool:
        pool.grade(["\\boxed{1}"], ["1"])  # workers started and warm (import excluded)
        t0 = time.perf_counter()
        out = pool.grade(responses, gts, timeout_s=10.0)
        rates[f"pool{workers}"].append(len(rows) / (time.perf_counter() - t0))
      assert out.sum() == len(rows)
    # Peer: plain in-process math-verify in a fresh interpreter (no isolation, no time bound).
    res = subprocess.run([sys.executable, "-c", _INPROC.format(repo=str(REPO), path=str(path))],
                         capture_output=True, text=True, check=True)
    rate, n_ok = res.stdout.split()
    assert int(n_ok) == len(rows)
    rates["inproc"].append(float(rate))
  med = {k: statistics.median(v) for k, v in rates.items()}
  print(f"math (MATH-500 reference solutions, cold caches): pool 2 workers "
        f"{_fmt(rates['pool2'], 'grades/s')}; pool 1 worker {_fmt(rates['pool1'], 'grades/s')}; "
        f"in-process peer {_fmt(rates['inproc'], 'grades/s')}; ratios pool2/in-process "
        f"{med['pool2'] / med['inproc']:.2f}, pool2/pool1 {med['pool2'] / med['pool1']:.2f}")


def bench_code(reps: int, n_problems: int) -> None:
  rows = [json.loads(l) for l in gzip.open(SHARED / "humanevalplus" /
                                           "HumanEvalPlus-v0.1.10.jsonl.gz", "rt")]
  # The fastest problems dominate RL-style use; take the first n by size of their test inputs.
  rows = sorted(rows, key=lambda r: len(json.dumps(r["plus_input"])))[:n_problems]
  for r in rows:
    code.humaneval_expected_outputs(r)
  n_inputs = sum(len(r["base_input"]) + len(r["plus_input"]) for r in rows)
  seq, par = [], []
  for _ in range(reps):
    t0 = time.perf_counter()
    assert all(code.run_humaneval(r, r["canonical_solution"]) for r in rows)
    seq.append(len(rows) / (time.perf_counter() - t0))
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(2) as ex:
      assert all(ex.map(lambda r: code.run_humaneval(r, r["canonical_solution"]), rows))
    par.append(len(rows) / (time.perf_counter() - t0))
  print(f"code: HumanEval+ canonical, {len(rows)} problems ({n_inputs} calls): sequential "
        f"{_fmt(seq, 'problems/s')}; 2 concurrent sandboxes {_fmt(par, 'problems/s')}")


def bench_overhead(reps: int, n: int = 20) -> None:
  prog = "import sys\nprint(sys.stdin.read().strip())\n"
  bare_ms, sbx_ms, case_ms = [], [], []
  with tempfile.TemporaryDirectory() as d:
    path = os.path.join(d, "p.py")
    with open(path, "w") as f:
      f.write(prog)
    for _ in range(reps):
      t0 = time.perf_counter()
      for _ in range(n):
        subprocess.run([sys.executable, "-I", path], input=b"x", capture_output=True, check=True)
      bare_ms.append(1000 * (time.perf_counter() - t0) / n)
      t0 = time.perf_counter()
      for _ in range(n):
        assert sandbox.run_cases({"p.py": prog}, "p.py", [b"x"], timeout_s=10)[0].ok
      sbx_ms.append(1000 * (time.perf_counter() - t0) / n)
      t0 = time.perf_counter()
      res = sandbox.run_cases({"p.py": prog}, "p.py", [b"x"] * n, timeout_s=10)
      assert all(r.ok for r in res)
      case_ms.append(1000 * (time.perf_counter() - t0) / n)
  print(f"sandbox ({sandbox.sandbox_mode()} mode): one execution {_fmt(sbx_ms, 'ms')} vs bare "
        f"subprocess {_fmt(bare_ms, 'ms')}: overhead "
        f"{statistics.median(sbx_ms) - statistics.median(bare_ms):.1f} ms, ratio "
        f"{statistics.median(sbx_ms) / statistics.median(bare_ms):.2f}; per case with {n} cases "
        f"in one sandbox {_fmt(case_ms, 'ms')}")


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--reps", type=int, default=3)
  parser.add_argument("--code-problems", type=int, default=40)
  args = parser.parse_args()
  bench_overhead(args.reps)
  if SHARED.is_dir():
    bench_math(args.reps)
    bench_code(args.reps, args.code_problems)
  else:
    print(f"{SHARED} not found: math and code throughput skipped")


if __name__ == "__main__":
  main()
