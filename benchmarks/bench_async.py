"""Stage 3 steps/s with asynchronous rollouts: ``rollout.max_staleness`` k = 0 (synchronous), 1, 2.

One Stage 3 run per block, on the main job's model (`configs/main.py`: the tiny Qwen3 of
`disa_jax.pipeline.sum_models`, warmed up on the sum task for ``--warmup`` steps so its answers
have the main job's lengths), the main job's rollout settings (8 prompts x G = 8, <= 8 new tokens,
2 mini-batches, shared-prompt packing) and its engine: the JAX sampler in its own generation
process, exchanging rollouts through shared memory. Each block is a fresh child process running
``--steps`` RL steps of ``--method`` at one k; blocks alternate k = 0, 1, 2, ... ``--blocks`` times.
Per block: the wall time of the steps after the first ``--skip`` (compilation) from the trainer's
own ``time/step_s`` (which, with k > 0, includes any wait for the batch), pooled per k; printed
are medians with min-max, steps/s, the ratio to k = 0, the time split of k = 0 (generation vs
update), and the load average before and after.

    python benchmarks/bench_async.py [--steps 60 --blocks 3 --ks 0,1,2 --method grpo]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import bench_stage3_vs_trl  # this script's directory: the tiny-Trainer run and the stats line
from transformers import AutoTokenizer

from disa_jax import config as config_lib
from disa_jax import rewards
from disa_jax.pipeline.sum_models import TinyLMSpec, WarmupSpec, save_model, train_sum_model
from disa_jax.rl.config import TrainConfig
from disa_jax.rl.prompts import PromptItem
from disa_jax.tasks.sum import SumTask

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("time/step_s", "time/generate_s", "time/train_s", "time/sync_s")


def build_model(path: Path, warmup_steps: int) -> None:
  """The main job's reference architecture, warmed up on the sum task, saved as an HF dir."""
  model, _ = train_sum_model(SumTask(0, 40), TinyLMSpec(), WarmupSpec(correct_frac=0.6, skew=1.0, steps=warmup_steps),
                             progress=False)
  save_model(model, path)


def run_block(model_dir: str, workdir: str, k: int, steps: int, method: str) -> list[dict]:
  """One Stage 3 run at staleness ``k`` (this process); its per-step metrics."""

  tok = AutoTokenizer.from_pretrained(model_dir)
  task = SumTask(0, 40)
  items = [PromptItem(f"n{n}", tuple(tok.encode(task.prompt(n), add_special_tokens=False)),
                      {"ground_truth": n}) for n in task.ns]
  objective = {"grpo": dict(name="grpo"),
               "vargrad": dict(name="vargrad", beta=15.0, scale="sum",
                               reward_transform={"kind": "raw"})}[method]
  cfg = config_lib.from_mapping(TrainConfig, dict(
      objective=objective, optim=dict(lr=3e-4, weight_decay=0.0),
      rollout=dict(prompts_per_batch=8, group_size=8, max_prompt_len=64, max_response_len=8,
                   num_minibatches=2, share_prompts=True, micro_batch_rows=4, max_staleness=k),
      checkpoint=dict(every=10 ** 6, keep=1), validation=dict(every=0), seed=0,
      total_steps=steps, progress_bar=False, tensorboard=False), "bench")
  return bench_stage3_vs_trl.run_trainer(cfg, model_dir, workdir, items,
                                         rewards.get_reward_fn("sum_task"))


def _child(args) -> None:
  history = run_block(args.model_dir, args.workdir, args.k, args.steps, args.method)
  print("RESULT " + json.dumps([{p: h[p] for p in PHASES} for h in history]), flush=True)


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--steps", type=int, default=60)
  ap.add_argument("--skip", type=int, default=5, help="first steps of a block left out (compile)")
  ap.add_argument("--blocks", type=int, default=3)
  ap.add_argument("--ks", default="0,1,2")
  ap.add_argument("--method", default="grpo", choices=("grpo", "vargrad"))
  ap.add_argument("--warmup", type=int, default=300, help="warm-up steps of the model")
  ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  ap.add_argument("--k", type=int, default=0, help=argparse.SUPPRESS)
  ap.add_argument("--model_dir", default="", help=argparse.SUPPRESS)
  ap.add_argument("--workdir", default="", help=argparse.SUPPRESS)
  args = ap.parse_args()
  if args.child:
    _child(args)
    return
  ks = [int(k) for k in args.ks.split(",")]
  load0 = os.getloadavg()
  with tempfile.TemporaryDirectory() as tmp:
    model_dir = Path(tmp) / "model"
    build_model(model_dir, args.warmup)
    per_k: dict[int, dict[str, list[float]]] = {k: {p: [] for p in PHASES} for k in ks}
    walls: dict[int, list[float]] = {k: [] for k in ks}
    for b in range(args.blocks):
      for k in ks:
        out = subprocess.run(
            [sys.executable, __file__, "--child", "--k", str(k), "--steps", str(args.steps),
             "--method", args.method, "--model_dir", str(model_dir),
             "--workdir", str(Path(tmp) / f"run_{b}_{k}")],
            cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True,
            check=False)
        line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if out.returncode or line is None:
          sys.exit(f"block {b} k={k} failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
        rows = json.loads(line[len("RESULT "):])[args.skip:]
        for p in PHASES:
          per_k[k][p] += [r[p] for r in rows]
        walls[k].append(sum(r["time/step_s"] for r in rows) / len(rows))
        print(f"block {b} k={k}: {len(rows) / sum(r['time/step_s'] for r in rows):.2f} steps/s",
              flush=True)
  print(f"\nStage 3 {args.method}, {args.steps} steps per block ({args.skip} skipped), "
        f"{args.blocks} blocks; load average before {load0[0]:.2f}, after {os.getloadavg()[0]:.2f}")
  base = statistics.median(per_k[ks[0]]["time/step_s"])
  for k in ks:
    med = statistics.median(per_k[k]["time/step_s"])
    block_rates = [1.0 / w for w in walls[k]]
    step = bench_stage3_vs_trl.stats_line(per_k[k]["time/step_s"])
    print(f"  k={k}: step {step}; {1.0 / med:.2f} steps/s "
          f"(blocks {min(block_rates):.2f}-{max(block_rates):.2f}); x{base / med:.2f} vs k={ks[0]}")
  k0 = per_k[ks[0]]
  print(f"  where k={ks[0]}'s step goes (medians): generate "
        f"{statistics.median(k0['time/generate_s']):.4f} s, update "
        f"{statistics.median(k0['time/train_s']):.4f} s, sync {statistics.median(k0['time/sync_s']):.4f} s")


if __name__ == "__main__":
  main()
