"""Stage 3 seconds per step per seed at the claims preset's run shape: S seeds as one batch
dimension (`disa_jax.rl.seed_batch`) against separate runs, and this tree against an older one
(issue 44, item 6).

The run: ``--method`` of `configs/main.py`'s ``claims`` preset (the small task n = 0..15, the tiny
Qwen3 of `disa_jax.pipeline.sum_models`, lr 5e-4, 8 prompts x G = 8 rows of <= 8 tokens, 2
mini-batches, shared-prompt packing, the exact tracker every `SMALL_TRACK` steps with
`SMALL_TRACK_SAMPLES` samples per prompt), on the job's own models, Stage 1 and anchor, prepared
once in ``--workdir`` by the main job's stages 0-2 (`SumJob`; minutes on 2 cores).

Blocks (``--blocks``), each a fresh child process that trains its seeds ``--steps`` steps from
scratch (its own compilations: nothing is cached between blocks):

- ``separate``: one seed by `run_stage3`, as the main job runs a seed (the JAX sampler in its own
  generation process);
- ``batch_S``: S seeds by `seed_batch.train_together` (one process, the samplers in it, every routed
  device call one vmapped program over the seeds); ``batch_1`` is one seed with its sampler in the
  trainer's process (`job_workers.together`), nothing routed;
- a ``base:`` prefix runs the block on the `disa_jax` of git revision ``--baseline-rev`` (extracted
  with `git archive`; it needs today's `SumJob` / `train_together` API): the "before" column;
- a ``+cache`` suffix gives the block's processes (and their generation processes) one persistent
  compilation cache, ``<workdir>/bench/jax_cache``, emptied before the first rep: rep 0 fills it,
  later reps load their programs from it, as the main job's later Stage 3 runs do
  (`MainConfig.compilation_cache`). Without the suffix nothing is cached.

Per block: the median (min-max) over its seeds of each seed's median ``time/step_s`` (metrics.jsonl,
the steps after the first ``--skip``: compilation), i.e. collect + score + update + sync; and the
block's wall time per step per seed (start-up, the tracker's measurements and checkpoints
included). Blocks alternate ``--reps`` times; per kind the medians (min-max) over reps, the ratio to
the first kind of ``--blocks`` in the same run, and the load average (`/proc/loadavg`) before and
after each block. (Before 2026-11-28 this script took the difference of two runs' wall times of 16
and 48 steps in one process; the second run reused the first one's compilations, which made
in-process blocks look 3x faster than they are: `results/seed_batch_cpu.json` is that flawed run.)

    python benchmarks/bench_seed_batch.py --workdir /tmp/disa_bench_seeds [--method disa]
        [--blocks base:batch_1,batch_1,batch_4 --baseline-rev HEAD~1] [--steps 96] [--reps 2]
        [--json out.json]
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# A child of a ``base:`` block imports the older tree's disa_jax (and configs/) first.
TREE = Path(os.environ.get("DISA_BENCH_TREE", str(ROOT)))
sys.path[:0] = [str(TREE), str(ROOT), str(ROOT / "benchmarks")]

from disa_jax import runtime  # noqa: E402

runtime.tune_host_allocator()  # as the main job's processes do, before JAX's CPU backend exists

from bench_stage3_vs_trl import extract_tree  # noqa: E402
from configs import main as main_config  # noqa: E402
from disa_jax.pipeline import job_workers  # noqa: E402
from disa_jax.pipeline.job_config import MainConfig  # noqa: E402
from disa_jax.pipeline.sum_job import SumJob  # noqa: E402
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
    cfgs.append(job_workers.together(c) if in_process else c)
  return cfgs


def run_block(args) -> dict:
  """One block in this process: its seeds' ``--steps`` steps from scratch; each seed's median
  step time after ``--skip`` steps and the block's wall time."""
  kind = args.block.split(":")[-1].removesuffix("+cache")
  d = Path(args.workdir) / "bench" / args.block.replace(":", "_").replace("+", "_")
  shutil.rmtree(d, ignore_errors=True)
  size = 1 if kind == "separate" else int(kind.split("_")[1])
  cfgs = seed_configs(args.workdir, args.method, size, args.steps, d,
                      in_process=kind != "separate")
  t0 = time.perf_counter()
  if kind == "separate":
    run_stage3(cfgs[0])
  else:
    seed_batch.train_together([functools.partial(run_stage3, c) for c in cfgs])
  wall = time.perf_counter() - t0
  steps = []
  for c in cfgs:
    rows = [json.loads(line) for line in (Path(c.workdir) / "metrics.jsonl").open()]
    times = [r["time/step_s"] for r in rows if r["step"] > args.skip]
    if len(times) < 3:
      raise SystemExit(f"{c.workdir}: {len(times)} steps after --skip {args.skip}; raise --steps")
    steps.append(statistics.median(times))
  shutil.rmtree(d, ignore_errors=True)
  return {"seeds": size, "wall": wall, "step_median_per_seed": steps}


def summarise(blocks: list[dict], steps: int) -> dict:
  """Per block kind over its reps: the step time (a batch's step serves S seeds: per seed it is
  the step / S), the wall time per step per seed, and both as ratios to the first kind's."""
  kinds: dict[str, dict[str, list[float]]] = {}
  for b in blocks:
    r = b["result"]
    k = kinds.setdefault(b["block"], {"step": [], "wall": [], "loads": []})
    k["step"].append(statistics.median(r["step_median_per_seed"]) / r["seeds"])
    k["wall"].append(r["wall"] / steps / r["seeds"])
    k["loads"].append((b["load_before"], b["load_after"]))
  out = {kind: {"step_per_seed_s": runtime.spread(v["step"]),
                "wall_per_step_per_seed_s": runtime.spread(v["wall"]), "loads": v["loads"]}
         for kind, v in kinds.items()}
  first = out[blocks[0]["block"]]
  for row in out.values():
    for key in ("step_per_seed_s", "wall_per_step_per_seed_s"):
      row[key]["ratio_to_first"] = first[key]["median"] / row[key]["median"]
  return out


def _child(args, kind: str, base: Path | None) -> dict:
  env = {k: v for k, v in os.environ.items() if k not in runtime.CACHE_ENV}
  if kind.startswith("base:"):
    env["DISA_BENCH_TREE"] = str(base)
  if kind.endswith("+cache"):
    env.update({"JAX_COMPILATION_CACHE_DIR": str(Path(args.workdir) / "bench" / "jax_cache"),
                "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
                "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"})
  cmd = [sys.executable, __file__, "--workdir", args.workdir, "--method", args.method,
         "--steps", str(args.steps), "--skip", str(args.skip), "--block", kind]
  proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, check=False)
  lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
  if proc.returncode or not lines:
    raise SystemExit(f"block {kind} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
  return json.loads(lines[-1][7:])


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--workdir", required=True)
  p.add_argument("--method", default="disa")
  p.add_argument("--blocks", default="separate,batch_1,batch_4")
  p.add_argument("--baseline-rev", default="")
  p.add_argument("--steps", type=int, default=96)
  p.add_argument("--skip", type=int, default=8, help="first steps left out (compilation)")
  p.add_argument("--reps", type=int, default=2)
  p.add_argument("--json", default="")
  p.add_argument("--block", default="", help=argparse.SUPPRESS)  # a child's block
  args = p.parse_args()
  if args.block:
    print("RESULT " + json.dumps(run_block(args)), flush=True)
    return
  kinds = args.blocks.split(",")
  for kind in kinds:
    name = kind.split(":")[-1]
    block = name.removesuffix("+cache")
    if kind.split(":")[0] not in ("base", name) or not (
        block == "separate" or (block.startswith("batch_") and block[6:].isdigit())):
      raise SystemExit(f"--blocks: unknown block {kind!r} ([base:]separate or [base:]batch_<S>, "
                       "optionally +cache)")
  if any(k.startswith("base:") for k in kinds) and not args.baseline_rev:
    raise SystemExit("--blocks with a base: block needs --baseline-rev")
  prepare(args.workdir, args.method)
  base = (extract_tree(args.baseline_rev, Path(tempfile.mkdtemp(prefix="bench_seed_base_")))
          if args.baseline_rev else None)
  if base is not None:
    subprocess.run(f"git -C {ROOT} archive {args.baseline_rev} configs | tar -x -C {base}",
                   shell=True, check=True)
  shutil.rmtree(Path(args.workdir) / "bench" / "jax_cache", ignore_errors=True)
  blocks = []
  for rep in range(args.reps):
    for kind in kinds:
      before = runtime.load_average()
      blocks.append({"block": kind, "rep": rep, "result": _child(args, kind, base),
                     "load_before": before, "load_after": runtime.load_average()})
      print(f"rep {rep} {kind}: {blocks[-1]['result']} load {before:.2f} -> "
            f"{blocks[-1]['load_after']:.2f}", flush=True)
  summary = summarise(blocks, args.steps)
  for kind, row in summary.items():
    st, wa = row["step_per_seed_s"], row["wall_per_step_per_seed_s"]
    print(f"{kind:>16}: step per seed {st['median'] * 1e3:.1f} ms ({st['min'] * 1e3:.1f}-"
          f"{st['max'] * 1e3:.1f}), x{st['ratio_to_first']:.2f} vs {kinds[0]}; wall per step per "
          f"seed {wa['median'] * 1e3:.1f} ms ({wa['min'] * 1e3:.1f}-{wa['max'] * 1e3:.1f}), "
          f"x{wa['ratio_to_first']:.2f}; loads {row['loads']}")
  if args.json:
    Path(args.json).write_text(json.dumps({"blocks": blocks, "summary": summary,
                                           "args": vars(args), "baseline_rev": args.baseline_rev},
                                          indent=1))


if __name__ == "__main__":
  main()
