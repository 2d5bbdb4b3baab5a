"""Two Stage 3 runs at once on the main job's worker pool, each worker pinned to its own CPUs
(`MainConfig.pin_workers`, `job_workers.spawn_pool`) against unpinned workers (issue 62: the default
job within 15 minutes on 2 cores).

The run: ``--run`` of a finished main-job workdir (``<workdir>/stage3/<run>/config.json``: the job's
own models, anchor, prompts, tracker and engine), cut to ``--steps`` steps; two copies of it (the
same seed, workdirs of their own) go to `job_workers.run_stage3_units` on 2 workers, the job's own
path, with one persistent compilation cache as the job's processes share. A warm-up block (not
timed) fills the cache; then the pinned and unpinned blocks alternate ``--blocks`` times, the
first kind changing each block. Per kind: the block's wall time (the pool's, start-up and the
tracker's measurements included) and the runs' median ``time/step_s`` (metrics.jsonl, after the
first ``--skip`` steps), medians (min-max) over blocks, the ratio pinned / unpinned, the load
average before each block; and whether every run's metrics (all but the ``time/*`` ones and
``tokens_per_s``) equal the warm-up run's bit for bit.

    python benchmarks/bench_worker_pinning.py --workdir /work/runs/default_amd --run disa \\
        [--steps 200] [--blocks 3] [--skip 10] [--json out.json]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

from disa_jax import artifacts, codec, runtime  # noqa: E402
from disa_jax.pipeline import job_workers  # noqa: E402
from disa_jax.workflows.stage3 import Stage3Config  # noqa: E402

KINDS = ("pinned", "unpinned")


def run_configs(workdir: Path, run: str, steps: int, out: Path) -> list[Stage3Config]:
  """Two copies of the job's ``run`` config cut to ``steps`` steps, in ``out/a`` and ``out/b``."""
  cfg = codec.load(Stage3Config, workdir / "stage3" / run / "config.json", "the run's config")
  train = dataclasses.replace(cfg.train, total_steps=steps, progress_bar=False)
  return [dataclasses.replace(cfg, workdir=str(out / name), train=train) for name in ("a", "b")]


def _rows(run_dir: str) -> list[dict]:
  return artifacts.read_jsonl(Path(run_dir, "metrics.jsonl"), "the Stage 3 metrics")


def metrics(run_dir: str) -> list[dict]:
  """The run's metrics rows without the timings (what must not depend on pinning)."""
  return [{k: v for k, v in r.items() if not k.startswith("time/") and k != "tokens_per_s"}
          for r in _rows(run_dir)]


def step_median(run_dir: str, skip: int) -> float:
  return statistics.median(r["time/step_s"] for r in _rows(run_dir) if "time/step_s" in r
                           and r["step"] > skip)


def run_block(cfgs: list[Stage3Config], pin: bool) -> float:
  """Both runs from empty workdirs on a fresh 2-worker pool; the pool's wall seconds."""
  for cfg in cfgs:
    shutil.rmtree(cfg.workdir, ignore_errors=True)
  t0 = time.perf_counter()
  job_workers.run_stage3_units([[c] for c in cfgs], [[Path(c.workdir).name] for c in cfgs], 2,
                               lambda names, seconds: None, pin=pin)
  return time.perf_counter() - t0


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--workdir", required=True, help="a finished main-job workdir")
  p.add_argument("--run", default="disa")
  p.add_argument("--steps", type=int, default=200)
  p.add_argument("--blocks", type=int, default=3)
  p.add_argument("--skip", type=int, default=10)
  p.add_argument("--out", default="/tmp/disa_bench_pinning")
  p.add_argument("--json", default="")
  args = p.parse_args()
  out = Path(args.out)
  shutil.rmtree(out, ignore_errors=True)
  runtime.persistent_compilation_cache(out / "jax_cache")
  cfgs = run_configs(Path(args.workdir), args.run, args.steps, out / "runs")
  run_block(cfgs, pin=False)  # warm-up: fills the compilation cache
  want = metrics(cfgs[0].workdir)
  got = {k: {"wall_s": [], "step_s": [], "load": []} for k in KINDS}
  same = True
  for b in range(args.blocks):
    for kind in (KINDS if b % 2 == 0 else KINDS[::-1]):
      got[kind]["load"].append(runtime.load_average())
      got[kind]["wall_s"].append(run_block(cfgs, pin=kind == "pinned"))
      got[kind]["step_s"] += [step_median(c.workdir, args.skip) for c in cfgs]
      same = same and all(metrics(c.workdir) == want for c in cfgs)
      print(f"block {b} {kind:8s} wall {got[kind]['wall_s'][-1]:.1f} s (load before "
            f"{got[kind]['load'][-1]:.1f})", flush=True)
  summary = {k: {"wall_s": runtime.spread(g["wall_s"]), "step_s": runtime.spread(g["step_s"])}
             for k, g in got.items()}
  ratio = {m: summary["pinned"][m]["median"] / summary["unpinned"][m]["median"]
           for m in ("wall_s", "step_s")}
  for k in KINDS:
    w, s = summary[k]["wall_s"], summary[k]["step_s"]
    print(f"{k:8s} block wall {w['median']:.1f} s ({w['min']:.1f}-{w['max']:.1f}), step "
          f"{s['median']:.4f} s ({s['min']:.4f}-{s['max']:.4f})")
  print(f"pinned / unpinned: wall x{ratio['wall_s']:.3f}, step x{ratio['step_s']:.3f}; metrics "
        f"bit-identical to the warm-up run: {same}; load now {runtime.load_average():.1f}")
  if args.json:
    Path(args.json).write_text(json.dumps({
        "machine": runtime.host_description(), "args": vars(args), "blocks": got,
        "summary": summary, "ratio_pinned_to_unpinned": ratio, "bit_identical": same,
        "load_after": runtime.load_average()}, indent=1))


if __name__ == "__main__":
  main()
