"""Stage 3 steps/s per seed with S seeds as one batch dimension (`disa_jax.rl.seed_batch`), against
separate runs, at the claims preset's run shape (issue 44, item 6).

The run: ``--method`` of `configs/main.py`'s ``claims`` preset (the small task n = 0..15, the tiny
Qwen3 of `disa_jax.pipeline.sum_models`, lr 5e-4, 8 prompts x G = 8 rows of <= 8 tokens, 2
mini-batches, shared-prompt packing, the exact tracker every `SMALL_TRACK` steps with
`SMALL_TRACK_SAMPLES` samples per prompt), on the job's own models, Stage 1 and anchor, prepared
once in ``--workdir`` by the main job's stages 0-2 (`SumJob`; minutes on 2 cores).

Blocks, each a fresh child process (its own compilations, nothing cached between blocks):

- ``separate``: one seed by `run_stage3`, as the main job runs a seed today (the JAX sampler in its
  own generation process). S separate runs cost S times this, one after another;
- ``batch S``: S seeds by `seed_batch.train_together` (one process, the samplers in it, every
  routed device call one vmapped program over the seeds), for each S of ``--sizes``.

Each block runs its seeds twice from scratch, for N1 and N2 steps (``--steps N1,N2``): the cost of a
step is (T(N2) - T(N1)) / (N2 - N1), everything a step costs included (the tracker's measurements
amortised over their interval, checkpoints, weight syncs, the host work of every seed), and the
start-up (loading, compiling) is T(N1) - N1 x that. Blocks alternate (separate, batch S1, ...)
``--reps`` times. Printed per block kind: medians (min-max) of the wall and CPU seconds per step
per seed (CPU: `time.process_time` of the block's process plus its finished children's, i.e.
the generation process), steps/s per seed, the speed-up against ``separate``, the start-up, and
the load average (`/proc/loadavg`) before and after each block. The machine is shared: the CPU
figures are the robust ones.

    python benchmarks/bench_seed_batch.py --workdir /tmp/disa_bench_seeds [--method disa]
        [--sizes 1,4,8] [--steps 16,48] [--reps 3] [--json out.json]
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the repository root, for configs/

from disa_jax import runtime  # noqa: E402

runtime.tune_host_allocator()  # as the main job's processes do, before JAX's CPU backend exists

from configs import main as main_config  # noqa: E402
from disa_jax.pipeline import sum_job  # noqa: E402
from disa_jax.pipeline.sum_job import MainConfig, SumJob  # noqa: E402
from disa_jax.rl import seed_batch  # noqa: E402
from disa_jax.workflows.stage3 import Stage3Config, run_stage3  # noqa: E402


def job(workdir: str, method: str, seeds: int) -> SumJob:
  """The claims preset's job for ``method`` with seeds 0..seeds-1 (its Stage 3 configs)."""
  c = main_config.get_config("claims")
  c.methods = (method,)
  c.seeds = tuple(range(seeds))
  c.runs[method].seeds = ()
  c.compare, c.controls = (), ()
  return SumJob(MainConfig.from_config(c), workdir, progress=False)


def prepare(workdir: str, method: str) -> None:
  """Stages 0-2 of the job (models, Stage 1, exact log Z, Stage 2; skipped when done)."""
  j = job(workdir, method, 1)
  j.build_models()
  j.stage1()
  j.exact()
  j.stage2()


def seed_configs(workdir: str, method: str, size: int, steps: int, out: Path,
                 in_process: bool) -> list[Stage3Config]:
  """``size`` seeds of the run at ``steps`` steps, in fresh directories under ``out``."""
  j = job(workdir, method, size)
  cfgs = []
  for s in range(size):
    c = j.stage3_cfgs[(method, s)]
    c = dataclasses.replace(c, workdir=str(out / f"seed{s}"),
                            train=dataclasses.replace(c.train, total_steps=steps))
    cfgs.append(sum_job.together(c) if in_process else c)
  return cfgs


def _cpu() -> float:
  own = time.process_time()
  ch = resource.getrusage(resource.RUSAGE_CHILDREN)
  return own + ch.ru_utime + ch.ru_stime


def run_block(args) -> dict:
  """One block in this process: N1 then N2 steps from scratch; wall and CPU seconds of each."""
  out = {}
  for steps in args.steps:
    d = Path(args.workdir) / "bench" / f"{args.block}_{steps}"
    shutil.rmtree(d, ignore_errors=True)
    size = 1 if args.block == "separate" else int(args.block.split("_")[1])
    cfgs = seed_configs(args.workdir, args.method, size, steps, d,
                        in_process=args.block != "separate")
    t0, c0 = time.perf_counter(), _cpu()
    if args.block == "separate":
      run_stage3(cfgs[0])
    else:
      seed_batch.train_together([functools.partial(run_stage3, c) for c in cfgs])
    out[str(steps)] = {"wall": time.perf_counter() - t0, "cpu": _cpu() - c0, "seeds": size}
    shutil.rmtree(d, ignore_errors=True)
  return out


def _load() -> str:
  return Path("/proc/loadavg").read_text().split(" ")[0]


def summarise(blocks: list[dict], n1: int, n2: int) -> dict:
  """Per block kind: per-step-per-seed wall / CPU (medians, min-max), start-up, speed-up."""
  kinds: dict[str, list[dict]] = {}
  for b in blocks:
    r1, r2 = b["result"][str(n1)], b["result"][str(n2)]
    s = r1["seeds"]
    per = {k: (r2[k] - r1[k]) / (n2 - n1) / s for k in ("wall", "cpu")}
    start = {k: r1[k] - n1 * per[k] * s for k in ("wall", "cpu")}
    kinds.setdefault(b["block"], []).append({**{f"step_{k}": v for k, v in per.items()},
                                             **{f"startup_{k}": v for k, v in start.items()},
                                             "load": (b["load_before"], b["load_after"])})
  out = {}
  for kind, rows in kinds.items():
    med = lambda k: statistics.median(r[k] for r in rows)
    span = lambda k: (min(r[k] for r in rows), max(r[k] for r in rows))
    out[kind] = {k: {"median": med(k), "min": span(k)[0], "max": span(k)[1]}
                 for k in ("step_wall", "step_cpu", "startup_wall", "startup_cpu")}
    out[kind]["loads"] = [r["load"] for r in rows]
  base = out.get("separate")
  for kind, row in out.items():
    row["steps_per_s_per_seed_wall"] = 1.0 / row["step_wall"]["median"]
    row["steps_per_s_per_seed_cpu"] = 1.0 / row["step_cpu"]["median"]
    if base:
      row["speedup_wall"] = base["step_wall"]["median"] / row["step_wall"]["median"]
      row["speedup_cpu"] = base["step_cpu"]["median"] / row["step_cpu"]["median"]
  return out


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--workdir", required=True)
  p.add_argument("--method", default="disa")
  p.add_argument("--sizes", default="1,4,8")
  p.add_argument("--steps", default="16,48")
  p.add_argument("--reps", type=int, default=3)
  p.add_argument("--json", default="")
  p.add_argument("--block", default="", help=argparse.SUPPRESS)  # a child's block
  args = p.parse_args()
  args.steps = [int(x) for x in args.steps.split(",")]
  if len(args.steps) != 2 or not 0 < args.steps[0] < args.steps[1]:
    raise SystemExit(f"--steps must be N1,N2 with 0 < N1 < N2, got {args.steps}")
  if args.block:
    print("RESULT " + json.dumps(run_block(args)), flush=True)
    return
  prepare(args.workdir, args.method)
  kinds = ["separate"] + [f"batch_{int(s)}" for s in args.sizes.split(",")]
  blocks = []
  for rep in range(args.reps):
    for kind in kinds:
      before = _load()
      cmd = [sys.executable, __file__, "--workdir", args.workdir, "--method", args.method,
             "--steps", ",".join(map(str, args.steps)), "--block", kind]
      proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=False)
      lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
      if proc.returncode or not lines:
        raise SystemExit(f"block {kind} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
      blocks.append({"block": kind, "rep": rep, "result": json.loads(lines[-1][7:]),
                     "load_before": before, "load_after": _load()})
      print(f"rep {rep} {kind}: {blocks[-1]['result']} load {before} -> {_load()}", flush=True)
  summary = summarise(blocks, *args.steps)
  for kind, row in summary.items():
    sw, sc = row["step_wall"], row["step_cpu"]
    print(f"{kind:>10}: per step per seed wall {sw['median'] * 1e3:.0f} ms "
          f"({sw['min'] * 1e3:.0f}-{sw['max'] * 1e3:.0f}), CPU {sc['median'] * 1e3:.0f} ms "
          f"({sc['min'] * 1e3:.0f}-{sc['max'] * 1e3:.0f}); {row['steps_per_s_per_seed_wall']:.2f} "
          f"steps/s/seed (wall); x{row.get('speedup_wall', 1):.2f} wall, "
          f"x{row.get('speedup_cpu', 1):.2f} CPU vs separate; start-up "
          f"{row['startup_wall']['median']:.1f} s wall; loads {row['loads']}")
  if args.json:
    Path(args.json).write_text(json.dumps({"blocks": blocks, "summary": summary,
                                           "args": vars(args)}, indent=1))


if __name__ == "__main__":
  main()
