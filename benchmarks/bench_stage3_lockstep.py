"""Stage 3 step phases of several `disa_jax` trees run in lockstep, compared round by round.

`bench_stage3_vs_trl.py` alternates whole blocks (~20 s of one variant, then the next); on a 2-core
machine the machine's own speed moves by up to 30% between consecutive blocks, and every phase of a
block moves with it, the in-process update included (`results/stage3_vs_trl_cpu_issue64_20261207d/e`:
per-block ratios of 54fbaa7 to HEAD from 0.81x to 1.33x in the same phase). Here the variants'
trainers run at once, one child process each (each with its own generation process), and take
turns step by step: a token passed round a ring of pipes lets one child run one RL step and its
bookkeeping while the others wait (blocked on a pipe read, no CPU; their generation processes
idle). Step k of every variant thus runs within a few tenths of a second of the others.

Steps of one run are not independent replicates: in an A/A ring (one tree twice) the two copies'
per-step ratios once had a median of 1.21 with a step-level 95% interval of [1.15, 1.31]
(`results/lockstep_cpu_issue64_20261207.txt`), so whatever a run's processes draw (placement,
memory) holds for the whole run, and who runs just before a variant mattered too: with the ring's
order only rotated, one copy of an A/A pair ran 1.28x [1.14, 1.32] the other's step over 8 rounds,
each time right after the same other variant (`results/lockstep_cpu_issue64_20261207b.txt`). The
unit is therefore the round: a whole ring run, the rounds going through every cyclic order of the
variants (`ring_order`: over (n - 1)! rounds, each variant follows each other equally often); a
phase is compared by the ratio of the two variants' medians
in each round, summarised by the median over rounds with a distribution-free interval (binomial
order statistics of the rounds' ratios; with fewer than 6 rounds, their range). Name a variant
twice (``new,new,...``) to see the A/A spread of the same rounds.

Each child runs the GRPO loop of `bench_stage3_vs_trl.run_ours` (the same task, model and settings,
one path) with `disa_jax` imported from its variant's tree (``new``, ``git:<rev>``, with the cache
layout options of `bench_stage3_vs_trl.parse_variant`). Where the tree's generation process reports
it (`RemoteEngine.last_generate`), the generate phase is split into the engine's own seconds
(``engine``) and the rest of the call (``transport``: the request's and the results' way through
shared memory).

    python benchmarks/bench_stage3_lockstep.py --warm-model DIR --variants new,new,git:54fbaa7
        [--steps 60 --rounds 6 --workdir W --json-out F]

Use a multiple of (n - 1)! rounds for n variants (2 for three variants, 6 for four). Sittings
of one design (the same variant list; planned to be pooled before the later one ran) are read as
one by their ``--json-out`` files:

    python benchmarks/bench_stage3_lockstep.py --pool A.json B.json

``--warm-model`` is a warmed-up peer model directory that `bench_stage3_vs_trl.py` wrote
(``<workdir>/peer0/warm``).
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import bench_stage3_vs_trl as trl_bench

PHASES = trl_bench.PHASES + ("time/engine_s", "time/transport_s")
COMPILE_STEPS = 3  # the first steps of a run compile; left out of every pair
TOKEN = b"t"


def median_interval(xs: list[float], level: float = 0.95) -> tuple[float, float, float]:
  """(median, low, high): the sample median and a distribution-free interval for the population
  median of coverage >= ``level`` (order statistics k and n + 1 - k, k the largest with
  P(Binomial(n, 1/2) < k) <= (1 - level) / 2); (min, max) where no k reaches that (n < 6 at 95%)."""
  s, n = sorted(xs), len(xs)
  if n == 0:
    raise ValueError("median_interval: no values")
  tail, k, cdf = (1 - level) / 2, 1, 0.0
  while k < n:
    cdf += math.comb(n, k - 1) / 2 ** n  # P(Binomial(n, 1/2) <= k - 1)
    if cdf > tail:
      break
    k += 1
  k = max(1, k - 1)  # the loop stopped at the first k that does not reach the coverage
  return statistics.median(s), s[k - 1], s[n - k]


def _wait_turn(fd: int, timeout_s: float) -> None:
  ready, _, _ = select.select([fd], [], [], timeout_s)
  if not ready:
    raise TimeoutError(f"no turn within {timeout_s} s: another variant of the ring stopped")
  if os.read(fd, 1) != TOKEN:
    raise RuntimeError("the ring of turns was closed")


def take_turns(read_fd: int, write_fd: int, timeout_s: float) -> Callable[[], None]:
  """Makes this process's `Trainer.step` wait for the token before each step and pass it on at
  the next (so the loop's bookkeeping after a step stays inside its turn); records the engine's
  split of the generate phase where the tree's engine reports it. Returns the function that
  passes the token on for good (call it when the run ends)."""
  from disa_jax import rollout  # pylint: disable=g-import-not-at-top
  from disa_jax.rl import trainer as trainer_mod  # pylint: disable=g-import-not-at-top
  engines, held = [], [False]
  make_engine, step = rollout.make_engine, trainer_mod.Trainer.step

  def capture(*args, **kwargs):
    engines.append(make_engine(*args, **kwargs))
    return engines[-1]

  def release() -> None:
    if held[0]:
      os.write(write_fd, TOKEN)
      held[0] = False

  def turn(self, k: int):
    release()
    _wait_turn(read_fd, timeout_s)
    held[0] = True
    metrics = dict(step(self, k))
    timing = getattr(engines[0], "last_generate", None) if engines else None
    if timing:  # this step's one engine call (no replay in this loop)
      metrics["time/engine_s"] = timing["engine_s"]
      metrics["time/transport_s"] = metrics["time/generate_s"] - timing["engine_s"]
    return metrics

  rollout.make_engine = capture
  trainer_mod.Trainer.step = turn
  return release


def _child(spec: str) -> None:
  s = trl_bench.start_child(spec)
  release = take_turns(s["read_fd"], s["write_fd"], s["timeout_s"])
  try:
    hist = trl_bench.run_ours(s["model_dir"], Path(s["workdir"]), s["steps"], seed=s["seed"],
                              engine_options=s["engine_options"])
  finally:
    release()
  trl_bench.write_history(s["out"], hist)


def run_ring(variants: list[str], trees: dict[str, Path], model_dir: str, work: Path,
             steps: int, seed: int, timeout_s: float) -> list[list[dict]]:
  """One run of ``variants`` in lockstep (the first takes the first turn); their histories."""
  pipes = [os.pipe() for _ in variants]
  procs, outs = [], []
  for i, v in enumerate(variants):
    tree, opt, staleness = trl_bench.parse_variant(v)
    if staleness or opt not in ("",) + tuple(f"+{o}" for o in trl_bench.CACHE_OPTIONS):
      raise ValueError(f"--variants: {v!r}: only a tree and a cache layout option are supported")
    wd = work / f"{i}_{v.replace(':', '_').replace('+', '_')}"
    shutil.rmtree(wd, ignore_errors=True)
    outs.append(wd / "history.json")
    read_fd, write_fd = pipes[i][0], pipes[(i + 1) % len(variants)][1]
    spec = {"model_dir": model_dir, "workdir": str(wd), "steps": steps, "seed": seed,
            "engine_options": {"cache_layout": opt[1:]} if opt else None, "out": str(outs[-1]),
            "read_fd": read_fd, "write_fd": write_fd, "timeout_s": timeout_s}
    env = dict(os.environ, PYTHONPATH=f"{trees[tree]}{os.pathsep}{Path(__file__).parent}",
               CUDA_VISIBLE_DEVICES="", JAX_PLATFORMS="cpu")
    procs.append(subprocess.Popen([sys.executable, __file__, "--child", json.dumps(spec)],
                                  env=env, pass_fds=(read_fd, write_fd),
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
  os.write(pipes[0][1], TOKEN)
  try:
    for v, p in zip(variants, procs):
      _, err = p.communicate()
      if p.returncode != 0:
        raise RuntimeError(f"lockstep run of {v} failed ({p.returncode}):\n{err[-3000:]}")
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
    for r, w in pipes:
      os.close(r)
      os.close(w)
  return [json.loads(o.read_text()) for o in outs]


def ring_order(n: int, r: int) -> list[int]:
  """The variants' order in round ``r``: the rounds go through every cyclic order of the n
  variants (who follows whom), each started at a position one further than its last use, so over
  (n - 1)! rounds each variant follows each other one equally often."""
  cycles = [(0, *rest) for rest in itertools.permutations(range(1, n))]
  cycle = cycles[r % len(cycles)]
  start = (r // len(cycles)) % n
  return list(cycle[start:] + cycle[:start])


def label_variants(variants: list[str]) -> list[str]:
  """Distinct labels: a variant named again gets '#2', '#3', ..."""
  seen: dict[str, int] = {}
  out = []
  for v in variants:
    seen[v] = seen.get(v, 0) + 1
    out.append(v if seen[v] == 1 else f"{v}#{seen[v]}")
  return out


def run_median(run: list[dict], key: str) -> float | None:
  """The median of ``key`` over a run's steps after compilation (None: the run did not log it)."""
  xs = [h[key] for h in run[COMPILE_STEPS:] if key in h]
  return statistics.median(xs) if xs else None


def round_ratios(a: list[list[dict]], b: list[list[dict]], key: str) -> list[float]:
  """Per round, the median of ``key`` in ``a``'s run over that in ``b``'s (rounds both logged)."""
  out = []
  for ra, rb in zip(a, b):
    x, y = run_median(ra, key), run_median(rb, key)
    if x is not None and y is not None and y > 0:
      out.append(x / y)
  return out


def summarize(labels: list[str], runs: dict[str, list[list[dict]]]) -> list[str]:
  """The report's lines: per-variant phase medians, then each variant against the first by
  rounds."""
  lines = ["per phase, medians (min-max) in ms over every step after compilation, all rounds:"]
  for v in labels:
    steps = [h for run in runs[v] for h in run[COMPILE_STEPS:]]
    parts = []
    for k in PHASES:
      xs = [h[k] for h in steps if k in h]
      if xs:
        parts.append(f"{k[5:-2]} {1e3 * statistics.median(xs):.2f} "
                     f"({1e3 * min(xs):.2f}-{1e3 * max(xs):.2f})")
    lines.append(f"  {v:16s} n={len(steps)}: " + ", ".join(parts))
  lines.append(f"{labels[0]} / other: the ratio of run medians per round, median over rounds "
               "[95% interval] (n rounds; per-round ratios):")
  for v in labels[1:]:
    lines.append(f"  {labels[0]} / {v}:")
    for k in PHASES:
      rs = round_ratios(runs[labels[0]], runs[v], k)
      if rs:
        med, lo, hi = median_interval(rs)
        lines.append(f"    {k[5:-2]:9s} {med:.3f} [{lo:.3f}, {hi:.3f}] (n={len(rs)}; "
                     + " ".join(f"{r:.2f}" for r in rs) + ")")
  return lines


def pool(paths: list[str]) -> tuple[list[str], dict[str, list[list[dict]]]]:
  """The rounds of several ``--json-out`` results as one run's: the files' variant labels must
  agree (an error names the file that differs)."""
  labels: list[str] = []
  runs: dict[str, list[list[dict]]] = {}
  for path in paths:
    got = json.loads(Path(path).read_text())["runs"]
    if not labels:
      labels, runs = list(got), {v: [] for v in got}
    elif list(got) != labels:
      raise ValueError(f"{path}: variants {list(got)} differ from {paths[0]}'s {labels}")
    for v, rounds in got.items():
      runs[v].extend(rounds)
  return labels, runs


def _parse_args():
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--warm-model", help="a warmed-up peer model dir (bench_stage3_vs_trl's "
                                       "<workdir>/peer0/warm)")
  ap.add_argument("--variants", default="new,new",
                  help="comma list of new | git:<rev>, each optionally +dense, +ragged or +auto; "
                       "a name may repeat (an A/A pair)")
  ap.add_argument("--steps", type=int, default=60)
  ap.add_argument("--rounds", type=int, default=6,
                  help="runs of the ring, its order rotated by one variant each round")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--timeout-s", type=float, default=900.0,
                  help="a child waiting longer than this for its turn stops")
  ap.add_argument("--workdir", default=None)
  ap.add_argument("--json-out", default=None)
  ap.add_argument("--pool", nargs="+", default=None,
                  help="summarise the rounds of these --json-out files as one (runs nothing)")
  ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
  return ap.parse_args()


def main():
  args = _parse_args()
  if args.child:
    return _child(args.child)
  if args.pool:
    try:
      labels, runs = pool(args.pool)
    except (OSError, ValueError, KeyError) as e:
      sys.exit(f"--pool: {e}")
    print(f"lockstep GRPO steps, {len(runs[labels[0]])} rounds pooled from {', '.join(args.pool)}")
    print("\n".join(summarize(labels, runs)))
    return None
  if not args.warm_model or not Path(args.warm_model, "config.json").exists():
    sys.exit(f"--warm-model: no model directory at {args.warm_model!r}")
  variants = [v for v in args.variants.split(",") if v]
  if len(variants) < 2 or args.steps <= COMPILE_STEPS or args.rounds < 1:
    sys.exit(f"need >= 2 variants, --steps > {COMPILE_STEPS} and --rounds >= 1")
  work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_lockstep_"))
  work.mkdir(parents=True, exist_ok=True)
  trees = {"new": trl_bench.ROOT}
  for v in variants:
    tree = trl_bench.parse_variant(v)[0]
    if tree.startswith("git:") and tree not in trees:
      trees[tree] = trl_bench.extract_tree(tree[4:], work / f"tree_{tree[4:]}")
    elif tree == "base":
      sys.exit("--variants: name a revision as git:<rev> here")
  labels = label_variants(variants)
  runs: dict[str, list[list[dict]]] = {v: [] for v in labels}
  loads, orders = [], []
  for r in range(args.rounds):
    order = ring_order(len(variants), r)
    loads.append(os.getloadavg()[0])
    orders.append([labels[i] for i in order])
    t0 = time.monotonic()
    hists = run_ring([variants[i] for i in order], trees, args.warm_model, work / f"round{r}",
                     args.steps, args.seed, args.timeout_s)
    for i, h in zip(order, hists):
      runs[labels[i]].append(h)
    print(f"round {r} (load {loads[-1]:.1f}, order {' -> '.join(orders[-1])}): "
          f"{time.monotonic() - t0:.0f} s", flush=True)
  lines = summarize(labels, runs)
  print(f"\nlockstep GRPO steps (bench_stage3_vs_trl's task), {args.rounds} round(s) x "
        f"{args.steps} steps, the first {COMPILE_STEPS} of each run left out; load average now "
        f"{os.getloadavg()[0]:.1f}")
  print("\n".join(lines))
  if args.json_out:
    Path(args.json_out).write_text(json.dumps(
        {"command": " ".join(sys.argv), "load_before_round": loads, "orders": orders,
         "runs": {v: [[{k: float(f"{h[k]:.6g}") for k in PHASES + ("reward",) if k in h}
                       for h in run]
                      for run in rs] for v, rs in runs.items()}}, separators=(",", ":")))


if __name__ == "__main__":
  main()
