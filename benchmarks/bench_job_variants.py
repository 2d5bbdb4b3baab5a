"""The default job's Stage 3 runs under variants of its config (each a set of ``--config.``
overrides), two runs at a time on the machine's cores, as `python -m launch.main` trains them: what
a runtime option costs or saves per run of the job (issue 44, item 6 and issue 62: the budget).

A block is the main job (`launch/main.py`, the default preset) on a copy of a prepared workdir
(models, Stages 1-2 and a filled compilation cache, made once by ``--prepare``), training
``--method`` for ``--seeds`` Stage 3 seeds of ``--steps`` steps with ``stage3_workers = 2`` under one
variant. Blocks alternate ``--reps`` times. Per variant: the median (min-max) over blocks of the
median seconds per run (`times.json`, each run's whole `run_stage3`: start-up, steps, the exact
tracker and the export) and of the median ``time/step_s`` over every run's steps after the first
``--skip``; the ratio of each to the first variant; the load average (`/proc/loadavg`) before and
after each block.

A variant is ``NAME:FIELD=VALUE[;FIELD=VALUE...]`` (fields of configs/main.py). The default pair
is the engine's placement: a generation process per run against the JAX sampler in the run's
process (`EngineConfig.separate_process`; benchmarks/results/engine_placement_cpu.json).

    python benchmarks/bench_job_variants.py --workdir /tmp/disa_bench_place --prepare
    python benchmarks/bench_job_variants.py --workdir /tmp/disa_bench_place [--reps 3] \\
        [--variant process:engine.separate_process=True --variant inproc:...] [--steps 150] \\
        [--seeds 4] [--json out.json]
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
PLACEMENTS = ("process:engine.separate_process=True", "inproc:engine.separate_process=False")
# what a block reuses from the prepared workdir (its Stage 3 and evaluations are its own)
PREPARED = ("models", "data", "stage1", "stage2", "anchor", "anchor_exact", "exact.json",
            "jax_cache")


def parse_variant(text: str) -> tuple[str, tuple[str, ...]]:
  """``NAME:FIELD=VALUE[;FIELD=VALUE...]`` -> (name, ``--config.FIELD=VALUE`` flags)."""
  name, sep, body = text.partition(":")
  pairs = [p for p in body.split(";") if p]
  bad = [p for p in pairs if "=" not in p or not p.split("=", 1)[0]]
  if not name or not sep or not pairs or bad:
    raise SystemExit(f"--variant must be NAME:FIELD=VALUE[;FIELD=VALUE...], got {text!r}")
  return name, tuple(f"--config.{p}" for p in pairs)


def _job(workdir: Path, args, flags: tuple[str, ...]) -> None:
  """The default job in ``workdir``: ``args.seeds`` seeds of ``args.method`` under ``flags``."""
  seeds = ",".join(str(s) for s in range(args.seeds))
  cmd = [sys.executable, "-m", "launch.main", f"--workdir={workdir}",
         f"--config.methods=('{args.method}',)", f"--config.seeds=({seeds},)",
         f"--config.train.total_steps={args.steps}", "--config.sft_enabled=False", *flags]
  done = subprocess.run(cmd, cwd=ROOT, check=False, stdout=subprocess.DEVNULL,
                        stderr=subprocess.PIPE, text=True)
  if done.returncode:
    raise SystemExit(f"the job in {workdir} failed (exit {done.returncode}): "
                     f"{' '.join(cmd)}\n{done.stderr[-2000:]}")


def _median_step(run_dir: Path, skip: int) -> float:
  rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines() if l]
  return statistics.median([r["time/step_s"] for r in rows if "time/step_s" in r][skip:])


def run_block(args, variant: str, rep: int) -> dict:
  """One block: a fresh copy of the prepared workdir, the job under ``variant`` (`parse_variant`),
  its runs' seconds."""
  name, flags = parse_variant(variant)
  work = Path(args.workdir) / "blocks" / f"{name}_{rep}"
  shutil.rmtree(work, ignore_errors=True)
  work.mkdir(parents=True)
  for part in PREPARED:
    src = Path(args.workdir) / "prepared" / part
    if src.is_dir():
      shutil.copytree(src, work / part)
    elif src.exists():
      shutil.copy2(src, work / part)
  before, start = runtime.load_average(), time.perf_counter()
  _job(work, args, flags)
  wall = time.perf_counter() - start
  times = json.loads((work / "times.json").read_text())
  runs = {k: v for k, v in times.items() if k.startswith("stage3_")}
  steps = [_median_step(p, args.skip) for p in sorted((work / "stage3").iterdir())]
  shutil.rmtree(work / "stage3")
  return {"variant": name, "rep": rep, "wall_s": wall, "run_s": runs,
          "median_run_s": statistics.median(runs.values()),
          "median_step_s": statistics.median(steps), "load_before": before,
          "load_after": runtime.load_average()}


def summarise(blocks: list[dict], names: list[str]) -> dict:
  """Per variant: medians (min-max) over its blocks, and their ratios to the first variant's."""
  out = {}
  for p in names:
    mine = [b for b in blocks if b["variant"] == p]
    out[p] = {"run_s": runtime.spread([b["median_run_s"] for b in mine]),
              "step_s": runtime.spread([b["median_step_s"] for b in mine]),
              "blocks": len(mine)}
  first = out[names[0]]
  for p in names:
    out[p]["run_s_ratio"] = out[p]["run_s"]["median"] / first["run_s"]["median"]
    out[p]["step_s_ratio"] = out[p]["step_s"]["median"] / first["step_s"]["median"]
  return out


def prepare(args) -> None:
  """Models, Stages 1-2 and a compilation cache filled by one short run of each variant."""
  work = Path(args.workdir) / "prepared"
  shutil.rmtree(work, ignore_errors=True)
  work.mkdir(parents=True)
  for variant in args.variant:
    _job(work, argparse.Namespace(**{**vars(args), "seeds": 1, "steps": 16}),
         parse_variant(variant)[1])
    for outputs in ("stage3", "eval"):  # the next variant trains other bits
      shutil.rmtree(work / outputs)


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--workdir", required=True)
  p.add_argument("--prepare", action="store_true")
  p.add_argument("--method", default="disa")
  p.add_argument("--variant", action="append", default=[],
                 help="NAME:FIELD=VALUE[;...] (repeat; default: the engine placements)")
  p.add_argument("--steps", type=int, default=150)
  p.add_argument("--seeds", type=int, default=4, help="runs per block (2 at a time)")
  p.add_argument("--skip", type=int, default=8, help="first steps left out (compilation)")
  p.add_argument("--reps", type=int, default=3)
  p.add_argument("--json", default="")
  args = p.parse_args()
  args.variant = args.variant or list(PLACEMENTS)
  names = [parse_variant(v)[0] for v in args.variant]
  if len(set(names)) != len(names):
    raise SystemExit(f"--variant names must differ, got {names}")
  if args.prepare:
    prepare(args)
    return
  blocks = []
  for rep in range(args.reps):
    for variant, name in zip(args.variant, names):
      blocks.append(run_block(args, variant, rep))
      b = blocks[-1]
      print(f"rep {rep} {name:8s} run {b['median_run_s']:.1f} s, step "
            f"{b['median_step_s'] * 1e3:.1f} ms, wall {b['wall_s']:.0f} s, load "
            f"{b['load_before']:.2f} -> {b['load_after']:.2f}", flush=True)
  summary = summarise(blocks, names)
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
