"""Stage 3 step time: our GRPO (and DISA-loop) step vs TRL's GRPOTrainer on the same weights and task.

The peer is `../shared/peers/trl_grpo_bench.py` (TRL GRPOTrainer, PyTorch, CPU), run in its own
Python environment that has `trl` (``--trl-python``). It builds a tiny Qwen3, warms it up and saves it
as an HF directory; we load that same directory with `disa_jax.models.from_pretrained` and its
tokenizer with `AutoTokenizer`, and run our GRPO loop with the same settings: 8 prompts x 8 samples,
at most 8 new tokens, temperature 1, lr 1e-4, no KL, the same strict "a+b" reward on n = 0..40.

Blocks alternate (TRL, ours, TRL, ours, ...), each ``--steps`` RL steps; per-step wall times are
pooled per side (the first 3 steps of each of our blocks are compilation and are reported apart), and
medians with min-max and their ratio are printed.

    python benchmarks/bench_stage3_vs_trl.py --trl-python /tmp/trl_venv/bin/python [--steps 30 --blocks 2]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "Give two non-negative integers that sum to {n}:"
_PAIR = re.compile(r"(\d+)\s*\+\s*(\d+)|(\d+)\s+(\d+)")


def strict_pair_reward(text: str, n: int) -> float:
  """1 iff the stripped completion is exactly 'a+b' or 'a b' with a + b = n (the peer's task)."""
  m = _PAIR.fullmatch(text.strip())
  if not m:
    return 0.0
  a, b = [int(g) for g in m.groups() if g is not None]
  return float(a + b == n)


def run_trl(trl_python: str, peer: str, workdir: Path, steps: int, model: str | None) -> dict:
  args = [trl_python, peer, "--workdir", str(workdir), "--steps", str(steps), "--betas", "0",
          "--json-out", str(workdir / "summary.json")]
  if model:
    args += ["--model", model]
  env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
  out = subprocess.run(args, env=env, capture_output=True, text=True)
  if out.returncode != 0:
    raise RuntimeError(f"TRL peer failed ({out.returncode}):\n{out.stderr[-3000:]}")
  return json.loads((workdir / "summary.json").read_text())


def run_ours(model_dir: str, workdir: Path, steps: int, method: str, seed: int, scan_unroll: int = 1) -> list[dict]:
  import jax
  from transformers import AutoTokenizer

  from disa_jax import models
  from disa_jax.parallel import make_mesh
  from disa_jax.rl import config as C
  from disa_jax.rl.trainer import PromptItem, Trainer
  from disa_jax.rollout import make_engine
  from disa_jax.estimators import RewardTransform
  tok = AutoTokenizer.from_pretrained(model_dir)
  items = [PromptItem(f"n{n}", tuple(tok(PROMPT.format(n=n))["input_ids"]), {"n": n}) for n in range(41)]

  def reward_fn(its, resp):
    return np.asarray([strict_pair_reward(tok.decode(list(r), skip_special_tokens=True), it.meta["n"])
                       for it, r in zip(its, resp)], np.float32)

  cfg = C.TrainConfig(
      model=C.ModelCfg(policy_path=model_dir, dtype="float32", remat=False),
      loss=C.LossCfg(method=method, beta=1.0, length_normalize=False, reward_transform=RewardTransform("raw"),
                     omega_mode="one", eps_low=0.2, eps_high=0.2),
      optim=C.OptimCfg(lr=1e-4, weight_decay=0.0, grad_clip=1.0),
      rollout=C.RolloutCfg(prompts_per_batch=8, group_size=8, max_prompt_len=64, max_response_len=8,
                           engine="jax", num_minibatches=1, micro_batch_size=64),
      data=C.DataCfg(anchor_path=""), mesh=C.MeshCfg(1, 1, 1),
      checkpoint=C.CheckpointCfg(every=10 ** 6, keep=1, async_save=True),
      seed=seed, total_steps=steps, progress_bar=False, tensorboard=False)
  with make_engine("jax", model_dir) as engine:
    policy = models.from_pretrained(model_dir)
    policy.scan_unroll = scan_unroll  # 1: the rolled scan over layers; num_layers: fully unrolled
    trainer = Trainer(cfg, str(workdir), policy=policy,
                      reference=models.from_pretrained(model_dir), engine=engine, prompts=items,
                      reward_fn=reward_fn, stop_token_ids=(tok.eos_token_id,), pad_id=tok.pad_token_id,
                      mesh=make_mesh(1, 1, 1, devices=jax.devices()[:1]), pad_to=16)
    try:
      return trainer.run()
    finally:
      trainer.close()


def _stats(xs):
  return f"median {statistics.median(xs):.4f} s (min {min(xs):.4f}, max {max(xs):.4f}, n={len(xs)})"


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--trl-python", required=True, help="a python with torch==2.13.0 and trl installed")
  ap.add_argument("--peer", default=str(ROOT.parent / "shared" / "peers" / "trl_grpo_bench.py"))
  ap.add_argument("--steps", type=int, default=30)
  ap.add_argument("--blocks", type=int, default=2)
  ap.add_argument("--workdir", default=None)
  ap.add_argument("--scan-unroll", type=int, default=1, help="unroll of our scan over decoder layers")
  args = ap.parse_args()
  if not Path(args.peer).exists():
    sys.exit(f"peer script not found: {args.peer}")
  work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_trl_"))
  work.mkdir(parents=True, exist_ok=True)
  trl_steps, ours_steps, ours_compile, rewards = [], [], [], {"trl": [], "ours": []}
  phases: dict[str, list[float]] = {}
  warm = work / "peer" / "warm"
  for b in range(args.blocks):
    s = run_trl(args.trl_python, args.peer, work / "peer" if b == 0 else work / f"peer{b}", args.steps,
                None if b == 0 else str(warm))
    run = s["runs"][0]
    trl_steps += run["step_seconds_per_step"]
    rewards["trl"].append(run["train_reward_last5_mean"])
    hist = run_ours(str(warm), work / f"ours{b}", args.steps, "grpo", seed=b, scan_unroll=args.scan_unroll)
    for k in ("time/rollout_s", "time/generate_s", "time/train_s", "time/sync_s"):
      phases.setdefault(k, []).extend(h[k] for h in hist[3:])
    t = [h["time/step_s"] for h in hist]
    ours_compile += t[:3]
    ours_steps += t[3:]
    rewards["ours"].append(float(np.mean([h["reward"] for h in hist[-5:]])))
    print(f"block {b}: trl {_stats(run['step_seconds_per_step'])} | ours {_stats(t[3:])}", flush=True)
  mt, mo = statistics.median(trl_steps), statistics.median(ours_steps)
  print(f"\nGRPO step (8 prompts x 8 samples, <= 8 new tokens), {args.blocks} alternating blocks of {args.steps} steps")
  print(f"  TRL GRPOTrainer : {_stats(trl_steps)}")
  print(f"  disa_jax GRPO   : {_stats(ours_steps)}   (first 3 steps per block, compilation: {_stats(ours_compile)})")
  print(f"  speed ratio (TRL time / ours): {mt / mo:.2f}x  -> target >= 1: {'MET' if mt / mo >= 1 else 'NOT MET'}")
  print(f"  train reward, mean of last 5 steps per block: trl {rewards['trl']}, ours {rewards['ours']}")
  print("  our step by phase (medians): " + ", ".join(f"{k[5:-2]} {statistics.median(v):.4f} s"
                                                    for k, v in phases.items()))


if __name__ == "__main__":
  main()
