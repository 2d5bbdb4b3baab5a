"""The default job's Stage 3 runs with the JAX sampler in each run's process against in a
generation process of its own (`EngineConfig.separate_process`), two runs at a time on the
machine's cores, as `python -m launch.main` trains them (issue 44, item 6: the budget).

A block is the main job (`launch/main.py`, the default preset) on a copy of a prepared workdir
(models, Stages 1-2 and a filled compilation cache, made once by ``--prepare``), training
``--method`` for ``--seeds`` Stage 3 seeds of ``--steps`` steps with ``stage3_workers = 2`` and one
engine placement: ``inproc`` (``--config.engine.separate_process=False``, the default job's) or
``process``. Blocks alternate ``--reps`` times. Per placement: the median (min-max) over blocks of
the median seconds per run (`times.json`, each run's whole `run_stage3`: start-up, steps, the
exact tracker and the export) and of the median ``time/step_s`` over every run's steps after the
first ``--skip``; the ratio of each to the first placement of ``--placements``; the load average
(`/proc/loadavg`) before and after each block.

    python benchmarks/bench_engine_placement.py --workdir /tmp/disa_bench_place --prepare
    python benchmarks/bench_engine_placement.py --workdir /tmp/disa_bench_place [--reps 3] \\
        [--placements process,inproc] [--steps 150] [--seeds 4] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from disa_jax import runtime

ROOT = Path(__file__).resolve().parents[1]
PLACEMENTS = {"inproc": "False", "process": "True"}
# what a block reuses from the prepared workdir (its Stage 3 and evaluations are its own)
PREPARED = ("models", "data", "stage1", "stage2", "anchor", "anchor_exact", "exact.json",
            "jax_cache")


def _job(workdir: Path, args, placement: str) -> None:
  """The default job in ``workdir``: ``args.seeds`` seeds of ``args.method``, one placement."""
  seeds = ",".join(str(s) for s in range(args.seeds))
  cmd = [sys.executable, "-m", "launch.main", f"--workdir={workdir}",
         f"--config.methods=('{args.method}',)", f"--config.seeds=({seeds},)",
         f"--config.train.total_steps={args.steps}", "--config.sft_enabled=False",
         f"--config.engine.separate_process={PLACEMENTS[placement]}"]
  subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _median_step(run_dir: Path, skip: int) -> float:
  rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines() if l]
  return statistics.median([r["time/step_s"] for r in rows if "time/step_s" in r][skip:])


def run_block(args, placement: str, rep: int) -> dict:
  """One block: a fresh copy of the prepared workdir, the job, its runs' seconds."""
  work = Path(args.workdir) / "blocks" / f"{placement}_{rep}"
  shutil.rmtree(work, ignore_errors=True)
  work.mkdir(parents=True)
  for name in PREPARED:
    src = Path(args.workdir) / "prepared" / name
    if src.is_dir():
      shutil.copytree(src, work / name)
    elif src.exists():
      shutil.copy2(src, work / name)
  before, start = runtime.load_average(), time.perf_counter()
  _job(work, args, placement)
  wall = time.perf_counter() - start
  times = json.loads((work / "times.json").read_text())
  runs = {k: v for k, v in times.items() if k.startswith("stage3_")}
  steps = [_median_step(p, args.skip) for p in sorted((work / "stage3").iterdir())]
  shutil.rmtree(work / "stage3")
  return {"placement": placement, "rep": rep, "wall_s": wall, "run_s": runs,
          "median_run_s": statistics.median(runs.values()),
          "median_step_s": statistics.median(steps), "load_before": before,
          "load_after": runtime.load_average()}


def summarise(blocks: list[dict], placements: list[str]) -> dict:
  out = {}
  for p in placements:
    mine = [b for b in blocks if b["placement"] == p]
    out[p] = {"run_s": runtime.spread([b["median_run_s"] for b in mine]),
              "step_s": runtime.spread([b["median_step_s"] for b in mine]),
              "blocks": len(mine)}
  first = out[placements[0]]
  for p in placements:
    out[p]["run_s_ratio"] = out[p]["run_s"]["median"] / first["run_s"]["median"]
    out[p]["step_s_ratio"] = out[p]["step_s"]["median"] / first["step_s"]["median"]
  return out


def prepare(args) -> None:
  """Models, Stages 1-2 and a compilation cache filled by one short run of each placement."""
  work = Path(args.workdir) / "prepared"
  shutil.rmtree(work, ignore_errors=True)
  work.mkdir(parents=True)
  for placement in PLACEMENTS:
    _job(work, argparse.Namespace(**{**vars(args), "seeds": 1, "steps": 16}), placement)
    shutil.rmtree(work / "stage3")


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--workdir", required=True)
  p.add_argument("--prepare", action="store_true")
  p.add_argument("--method", default="disa")
  p.add_argument("--placements", default="process,inproc")
  p.add_argument("--steps", type=int, default=150)
  p.add_argument("--seeds", type=int, default=4, help="runs per block (2 at a time)")
  p.add_argument("--skip", type=int, default=8, help="first steps left out (compilation)")
  p.add_argument("--reps", type=int, default=3)
  p.add_argument("--json", default="")
  args = p.parse_args()
  if args.prepare:
    prepare(args)
    return
  placements = args.placements.split(",")
  unknown = [x for x in placements if x not in PLACEMENTS]
  if unknown:
    raise SystemExit(f"--placements must name {sorted(PLACEMENTS)}, got {unknown}")
  blocks = []
  for rep in range(args.reps):
    for placement in placements:
      blocks.append(run_block(args, placement, rep))
      b = blocks[-1]
      print(f"rep {rep} {placement:8s} run {b['median_run_s']:.1f} s, step "
            f"{b['median_step_s'] * 1e3:.1f} ms, wall {b['wall_s']:.0f} s, load "
            f"{b['load_before']:.2f} -> {b['load_after']:.2f}", flush=True)
  summary = summarise(blocks, placements)
  for name, s in summary.items():
    print(f"{name:8s} run {s['run_s']['median']:.1f} s ({s['run_s']['min']:.1f}-"
          f"{s['run_s']['max']:.1f}) x{s['run_s_ratio']:.2f}; step "
          f"{s['step_s']['median'] * 1e3:.1f} ms ({s['step_s']['min'] * 1e3:.1f}-"
          f"{s['step_s']['max'] * 1e3:.1f}) "
          f"x{s['step_s_ratio']:.2f}")
  if args.json:
    Path(args.json).write_text(json.dumps(
        {"machine": runtime.host_description(), "args": vars(args), "summary": summary,
         "blocks": blocks},
        indent=1) + "\n")


if __name__ == "__main__":
  main()
