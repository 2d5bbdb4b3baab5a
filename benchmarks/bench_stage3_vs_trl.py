"""Stage 3 step time: our GRPO (and DISA-loop) step vs TRL's GRPOTrainer on the same weights and task.

The peer is `../shared/peers/trl_grpo_bench.py` (TRL GRPOTrainer, PyTorch, CPU), run in its own
Python environment that has `trl` (``--trl-python``). It builds a tiny Qwen3, warms it up and saves it
as an HF directory; we load that same directory with `disa_jax.models.from_pretrained` and its
tokenizer with `AutoTokenizer`, and run our GRPO loop with the same settings: 8 prompts x 8 samples,
at most 8 new tokens, temperature 1, lr 1e-4, no KL, the same strict "a+b" reward on n = 0..40.

Our step runs in a child process per block, one per variant (``--variants``):
- ``new``: this checkout's `disa_jax`, set up as the launch entry points set it up
  (`disa_jax.runtime.tune_host_allocator` on CPU: glibc keeps XLA's per-execution scratch block);
- ``base``: the `disa_jax` of git revision ``--baseline-rev`` (extracted with `git archive`; it
  must have today's Trainer API, e.g. 9d450af, the last commit before issue 14's changes), the
  "before" column;
- ``git:<rev>``: the `disa_jax` of any other git revision (several may be compared in one
  sitting, e.g. ``--variants git:54fbaa7,git:82d599f,new``);
- a ``+malloc`` suffix sets the same allocator settings through ``GLIBC_TUNABLES`` (for a base
  tree without `disa_jax.runtime`), ``+nomalloc`` turns `disa_jax.runtime`'s off
  (``DISA_HOST_MALLOC=0``), ``+dense`` / ``+ragged`` / ``+auto`` sample on the JAX sampler's
  dense cache layout (``cache_layout='dense'``, the path before continuous batching), its ragged
  one (continuous batching, the default before issue 64) or 'auto' (the default since: dense for
  a request whose rows all fit the slots on a short cache, as this bench's 64 rows do). XLA:CPU allocates each execution's temporaries as one block; above
  64 MiB (the update's is 64.5 MiB on this model) glibc maps it fresh from the kernel on every call
  and every page faults again (16.5k minor faults per update); kept, the block is reused;
- an ``@k<K>`` suffix runs the variant with asynchronous rollouts (``rollout.max_staleness = K``,
  `disa_jax.rl.async_rollout`), e.g. ``--variants new,new@k1``.

Blocks alternate (TRL, then each variant), each ``--steps`` RL steps; per-step wall times are
pooled per side (the first 3 steps of each of our blocks are compilation and are reported apart),
and medians with min-max, ratios TRL time / ours, and our per-phase medians (min-max) are printed;
the load average is read before each block (the machine may be shared). ``--json-out`` writes the
per-step times, the loads and the command line.

    python benchmarks/bench_stage3_vs_trl.py --trl-python /tmp/trl_venv/bin/python [--steps 30 --blocks 2]
        [--variants base,new+nomalloc,new --baseline-rev 9d450af] [--layout shared|padded|packed]

Our update runs on ``--layout`` (default 'shared': each prompt once per row, followed by its G
responses; `LAYOUTS` lists the layouts and what each measured).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
# (``time/pack_s``, the step's one packing, is its own phase since issue 64; older trees lack it)
PHASES = ("time/step_s", "time/rollout_s", "time/generate_s", "time/pack_s", "time/train_s",
          "time/sync_s")
MALLOC_TUNABLES = "glibc.malloc.arena_max=1:glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=17179869184"
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


# Our update's micro-batch layout (``--layout``; `disa_jax.rl.config.RolloutConfig` fields). The
# sequences are 18-19 prompt tokens + 1-8 response tokens, G = 8 per prompt. TRL step / ours, 3
# blocks x 30 steps, 2-core CPU shared with other jobs (load ~1.4):
# - 'shared': each prompt once in a row of 88 = 19 + 8 x 8 tokens, followed by its 8 responses
#   (8 rows x 88 = 704 tokens per update instead of 2,048; one row per group whatever the response
#   lengths, so one micro-batch, always): 1.45x (TRL 0.092 s, ours 0.063 s: train 0.032,
#   generate 0.021, sync 0.0075);
# - 'padded' (64 rows x 32, one sequence per row): 1.07x (train 0.064, generate 0.019); 0.77x
#   before the sampler's shared prefill (generate 0.037);
# - 'packed' (rows of 72 tokens, no sharing): 0.57x before the sampler's shared prefill (~24-token
#   sequences: 3 rarely fit a row, so 23-27 rows, often 2 micro-batches of 24 x 72).
# The code before packing (attention-mask padding) measured 0.96x.
LAYOUTS = {
    "shared": dict(packing=True, share_prompts=True, row_len=88, micro_batch_rows=8),
    "packed": dict(packing=True, micro_batch_rows=24),
    "padded": dict(packing=False, micro_batch_rows=64),
}


def run_ours(model_dir: str, workdir: Path, steps: int, seed: int, layout: str = "shared",
             staleness: int = 0, engine_options: dict | None = None) -> list[dict]:
  """Our GRPO loop (`disa_jax.rl.trainer.Trainer`) on the peer's model, task and settings."""
  from transformers import AutoTokenizer

  from disa_jax import config as config_lib
  from disa_jax.rewards.graded import Graded
  from disa_jax.rl.config import TrainConfig
  from disa_jax.rl.trainer import PromptItem
  tok = AutoTokenizer.from_pretrained(model_dir)
  items = [PromptItem(f"n{n}", tuple(tok(PROMPT.format(n=n))["input_ids"]), {"n": n}) for n in range(41)]

  def reward_fn(responses, metas):
    return Graded.ok([strict_pair_reward(r.text, m["n"]) for r, m in zip(responses, metas)])

  cfg = config_lib.from_mapping(TrainConfig, dict(
      objective=dict(name="grpo", eps_low=0.2, eps_high=0.2, kl_coef=0.0),
      optim=dict(lr=1e-4, weight_decay=0.0, grad_clip=1.0),
      rollout=dict(prompts_per_batch=8, group_size=8, max_prompt_len=64, max_response_len=8,
                   num_minibatches=1, **LAYOUTS[layout],
                   # (a base tree from before asynchronous rollouts has no such field)
                   **({"max_staleness": staleness} if staleness else {})),
      checkpoint=dict(every=10 ** 6, keep=1, async_save=True), validation=dict(every=0),
      seed=seed, total_steps=steps, progress_bar=False, tensorboard=False), "bench")
  return run_trainer(cfg, model_dir, workdir, items, reward_fn, engine_options)


def run_trainer(cfg, model_dir: str, workdir, items, reward_fn,
                engine_options: dict | None = None) -> list[dict]:
  """A Stage 3 run of ``cfg`` (a `TrainConfig`) on the HF directory ``model_dir`` (policy and
  pi_ref), its JAX sampler in its own generation process, one device; the per-step metrics."""
  import jax
  from transformers import AutoTokenizer

  from disa_jax import models
  from disa_jax.parallel import make_mesh
  from disa_jax.rl.build import build_trainer
  from disa_jax.rollout import make_engine
  tok = AutoTokenizer.from_pretrained(model_dir)
  decode = lambda ids: tok.decode(ids, skip_special_tokens=True)
  mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
  kwargs = {"options": engine_options} if engine_options else {}
  with make_engine("jax", model_dir, **kwargs) as engine:
    try:
      from disa_jax.rl.inputs import EngineLink, RolloutTask, StepModels
    except ImportError:  # a tree from before the step's typed inputs (e.g. 54fbaa7)
      trainer = build_trainer(
          cfg, str(workdir), policy=models.from_pretrained(model_dir),
          reference=models.from_pretrained(model_dir), engine=engine, prompts=items,
          reward_fn=reward_fn, decode=decode, stop_token_ids=(tok.eos_token_id,),
          pad_id=tok.pad_token_id, mesh=mesh, pad_to=16)
    else:
      trainer = build_trainer(
          cfg, str(workdir),
          StepModels(models.from_pretrained(model_dir), models.from_pretrained(model_dir), mesh,
                     pad_to=16),
          RolloutTask(items, reward_fn, decode, (tok.eos_token_id,), tok.pad_token_id),
          EngineLink(engine))
    try:
      return trainer.run()
    finally:
      trainer.close()


def stats_line(xs):
  return f"median {statistics.median(xs):.4f} s (min {min(xs):.4f}, max {max(xs):.4f}, n={len(xs)})"


def extract_tree(rev: str, dest: Path) -> Path:
  """`disa_jax` of git revision `rev` of this repository, extracted under `dest`; returns `dest`."""
  dest.mkdir(parents=True, exist_ok=True)
  archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "disa_jax"], check=True,
                           capture_output=True).stdout
  subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
  return dest


CACHE_OPTIONS = ("dense", "ragged", "auto")  # variant options naming the sampler's cache_layout


def parse_variant(variant: str) -> tuple[str, str, int]:
  """'new+nomalloc@k1' -> ('new', '+nomalloc', 1): the tree, the option, the staleness."""
  head, _, k = variant.partition("@k")
  tree, _, opt = head.partition("+")
  known = tree in ("base", "new") or (tree.startswith("git:") and len(tree) > 4)
  options = ("", "malloc", "nomalloc", *CACHE_OPTIONS)
  if not known or opt not in options or not (k == "" or k.isdigit()):
    raise ValueError(f"--variants: unknown variant {variant!r} (base|new|git:<rev>, optionally "
                     "+malloc, +nomalloc, +dense, +ragged or +auto, then optionally @k<K>)")
  return tree, f"+{opt}" if opt else "", int(k or 0)


def run_ours_child(variant: str, tree: Path, model_dir: str, workdir: Path, steps: int,
                   seed: int, layout: str) -> list[dict]:
  """Our GRPO run in a child process importing `disa_jax` from `tree`; returns its history."""
  out = workdir / "history.json"
  env = dict(os.environ, PYTHONPATH=str(tree), CUDA_VISIBLE_DEVICES="", JAX_PLATFORMS="cpu")
  _, opt, staleness = parse_variant(variant)
  if opt == "+malloc":
    env["GLIBC_TUNABLES"] = MALLOC_TUNABLES
  if opt == "+nomalloc":
    env["DISA_HOST_MALLOC"] = "0"  # `disa_jax.runtime` leaves glibc's defaults
  engine_options = {"cache_layout": opt[1:]} if opt[1:] in CACHE_OPTIONS else None
  args = [sys.executable, __file__, "--child", json.dumps(
      {"model_dir": model_dir, "workdir": str(workdir), "steps": steps, "seed": seed,
       "layout": layout, "staleness": staleness, "engine_options": engine_options,
       "out": str(out)})]
  proc = subprocess.run(args, env=env, capture_output=True, text=True)
  if proc.returncode != 0:
    raise RuntimeError(f"our run ({variant}) failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
  return json.loads(out.read_text())


def start_child(spec: str) -> dict:
  """A child run's spec (JSON) parsed, the host allocator set up as the launch entry points set
  it up (a tree from before `disa_jax.runtime` has none), its workdir made."""
  s = json.loads(spec)
  try:
    from disa_jax import runtime  # pylint: disable=g-import-not-at-top
    runtime.tune_host_allocator()
  except ImportError:
    pass
  Path(s["workdir"]).mkdir(parents=True, exist_ok=True)
  return s


def write_history(path: str, hist: list[dict]) -> None:
  """A run's per-step metrics as the parent reads them back (floats)."""
  Path(path).write_text(json.dumps([{k: float(v) for k, v in h.items()} for h in hist]))


def _child(spec: str) -> None:
  s = start_child(spec)
  hist = run_ours(s["model_dir"], Path(s["workdir"]), s["steps"], seed=s["seed"],
                  layout=s["layout"], staleness=s["staleness"],
                  engine_options=s.get("engine_options"))
  write_history(s["out"], hist)


def _parse_args():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--trl-python", help="a python with torch==2.13.0 and trl installed")
  ap.add_argument("--peer", default=str(ROOT.parent / "shared" / "peers" / "trl_grpo_bench.py"))
  ap.add_argument("--steps", type=int, default=30)
  ap.add_argument("--blocks", type=int, default=2)
  ap.add_argument("--workdir", default=None)
  ap.add_argument("--variants", default="new",
                  help="comma list of base | new | git:<rev>, each optionally +malloc "
                       "(GLIBC_TUNABLES), +nomalloc (DISA_HOST_MALLOC=0), +dense, +ragged or +auto "
                       "(the sampler's cache layout), then optionally @k<K> (max_staleness K)")
  ap.add_argument("--baseline-rev", default=None, help="git revision of the 'base' variant")
  ap.add_argument("--layout", choices=sorted(LAYOUTS), default="shared",
                  help="our update's micro-batch layout (a base tree must know its fields)")
  ap.add_argument("--warm-model", default=None,
                  help="reuse this warmed-up peer model dir (skips the peer's build and warm-up)")
  ap.add_argument("--json-out", default=None,
                  help="write the per-step times, the load before each block and the command")
  ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
  return ap.parse_args()


def _print_summary(args, trl_steps, trl_gen, ours, rewards) -> None:
  mt = statistics.median(trl_steps)
  print(f"\nGRPO step (8 prompts x 8 samples, <= 8 new tokens; our layout {args.layout}), "
        f"{args.blocks} alternating blocks of "
        f"{args.steps} steps; load average now {os.getloadavg()[0]:.1f}")
  print(f"  TRL GRPOTrainer : {stats_line(trl_steps)}; its generate {stats_line(trl_gen)}")
  for v, d in ours.items():
    steps = d["time/step_s"]
    ratio = mt / statistics.median(steps)
    print(f"  disa_jax {v:11s}: {stats_line(steps)}  TRL/ours {ratio:.2f}x -> target >= 1.25: "
          f"{'MET' if ratio >= 1.25 else 'NOT MET'}  (compilation steps: {stats_line(d['compile'])})")
  print("  per phase, medians (min-max) in s:")
  for v, d in ours.items():
    print(f"    {v:11s} " + ", ".join(
        f"{k[5:-2]} {statistics.median(d[k]):.4f} ({min(d[k]):.4f}-{max(d[k]):.4f})"
        for k in PHASES if d[k]))
  names = list(ours)
  if len(names) > 1:
    print("  phase ratios (median of first variant / median of each):")
    for v in names[1:]:
      print(f"    {names[0]} / {v}: " + ", ".join(
          f"{k[5:-2]} {statistics.median(ours[names[0]][k]) / statistics.median(ours[v][k]):.2f}x"
          for k in PHASES if ours[names[0]][k] and ours[v][k]))
  print(f"  train reward, mean of last 5 steps per block: trl {rewards.pop('trl')}, " + ", ".join(
      f"{v} {r}" for v, r in rewards.items()))


def main():
  args = _parse_args()
  if args.child:
    return _child(args.child)
  if not args.trl_python:
    sys.exit("--trl-python is required")
  if not Path(args.peer).exists():
    sys.exit(f"peer script not found: {args.peer}")
  variants = [v for v in args.variants.split(",") if v]
  for v in variants:
    try:
      parse_variant(v)
    except ValueError as e:
      sys.exit(str(e))
    if v.startswith("base") and not args.baseline_rev:
      sys.exit("--variants with 'base' needs --baseline-rev")
  work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_trl_"))
  work.mkdir(parents=True, exist_ok=True)
  trees = {"new": ROOT}
  if any(v.startswith("base") for v in variants):
    trees["base"] = extract_tree(args.baseline_rev, work / "base_tree")
  for v in variants:
    tree = parse_variant(v)[0]
    if tree.startswith("git:") and tree not in trees:
      trees[tree] = extract_tree(tree[4:], work / f"tree_{tree[4:]}")
  loads = []
  trl_steps, trl_gen, rewards = [], [], {"trl": [], **{v: [] for v in variants}}
  ours = {v: {k: [] for k in PHASES + ("compile",)} for v in variants}
  warm = Path(args.warm_model) if args.warm_model else work / "peer0" / "warm"
  for b in range(args.blocks):
    loads.append(os.getloadavg()[0])
    s = run_trl(args.trl_python, args.peer, work / f"peer{b}", args.steps,
                None if b == 0 and not args.warm_model else str(warm))
    run = s["runs"][0]
    trl_steps += run["step_seconds_per_step"]
    trl_gen.append(run["generate_seconds_per_step"]["median"])
    rewards["trl"].append(run["train_reward_last5_mean"])
    line = f"block {b} (load {loads[-1]:.1f}): trl {stats_line(run['step_seconds_per_step'])}"
    for v in variants:
      wd = work / f"ours_{v}_{b}"
      shutil.rmtree(wd, ignore_errors=True)
      hist = run_ours_child(v, trees[parse_variant(v)[0]], str(warm), wd, args.steps, b, args.layout)
      for k in PHASES:
        ours[v][k].extend(h[k] for h in hist[3:] if k in h)
      ours[v]["compile"].extend(h["time/step_s"] for h in hist[:3])
      rewards[v].append(round(float(np.mean([h["reward"] for h in hist[-5:]])), 4))
      line += f" | {v} {stats_line([h['time/step_s'] for h in hist[3:]])}"
    print(line, flush=True)
  if args.json_out:
    Path(args.json_out).write_text(json.dumps(
        {"command": " ".join(sys.argv), "load_before_block": loads, "trl_step_s": trl_steps,
         "trl_generate_s_median_per_block": trl_gen, "ours": ours, "rewards": rewards},
        indent=1))
  _print_summary(args, trl_steps, trl_gen, ours, rewards)


if __name__ == "__main__":
  main()
