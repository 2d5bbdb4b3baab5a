"""Generation with the JAX sampler and the policy's weight sync on one GPU (issue 31).

Generation: `JaxSampler` in this process on a preset with random bf16 weights (no download):
``--prompts`` prompts of ``--prompt-len`` random tokens, G = ``--group`` samples each, exactly
``--new-tokens`` new tokens per sample (temperature 1, no stop token). Tokens/s = P * G *
new_tokens / the wall time of `generate` (host packing and unpacking included), median of
``--reps`` calls after one untimed call (compilation).

Weight sync (``--sync-model``): the trainer's path of `PolicyUpdater.sync`: a policy with f32
parameters on the GPU is exported in HF names and layouts as bf16 host arrays
(`models.host_state_dict`: the cast and device -> host), then `update_weights` of a
JAX-engine generation process (`RemoteEngine`, spawned, its own GPU context) writes them into the
shared-memory block (host shm write) and the child loads them into its sampler
(`load_hf_state_dict`: host -> its device). The child starts from a checkpoint of the same shape
written to ``--tmp`` first. Each push is timed after one untimed push (the first creates and maps
the block); ``--sync-reps`` pushes.

Both processes run with XLA_PYTHON_CLIENT_PREALLOCATE=false (unless set): two JAX processes share
the GPU, and by default each would take 75% of it.

Usage: python benchmarks/bench_gpu_rollout.py [--models qwen3-0.6b,qwen3-4b-base] [--prompts 8,32]
    [--sync-model qwen3-4b-base] [--out FILE.jsonl]
"""
from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # before JAX is imported (see the module docstring)
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  _ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import argparse  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from typing import Any, Sequence  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from disa_jax import models  # noqa: E402
from disa_jax.models.config import ModelConfig, get_preset  # noqa: E402
from disa_jax.rollout import SamplingParams, make_engine  # noqa: E402
from disa_jax.rollout.jax_sampler import JaxSampler  # noqa: E402


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
  rng = np.random.default_rng(seed)
  return [rng.integers(3, vocab, length).tolist() for _ in range(n)]


def generation(c: ModelConfig, prompts: int, *, prompt_len: int, group: int, new_tokens: int,
               reps: int, dtype: Any = jnp.bfloat16) -> dict[str, Any]:
  """Tokens/s of `JaxSampler.generate` (see the module docstring)."""
  model = models.Transformer(c, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=dtype)
  sampler = JaxSampler(model, max_batch_size=max(256, prompts * group))
  batch = random_prompts(prompts, prompt_len, c.vocab_size)
  t0 = time.perf_counter()
  out = sampler.generate(batch, SamplingParams(n=group, max_tokens=new_tokens, seed=0))
  first_s = time.perf_counter() - t0
  expected = prompts * group * new_tokens
  times = []
  for rep in range(reps):
    t0 = time.perf_counter()
    out = sampler.generate(batch, SamplingParams(n=group, max_tokens=new_tokens, seed=rep + 1))
    times.append(time.perf_counter() - t0)
    got = sum(len(s.token_ids) for per in out for s in per)
    if got != expected:
      raise RuntimeError(f"generated {got} tokens, expected {expected}")
  sampler.close()
  seconds = statistics.median(times)
  return dict(kind="generate", prompts=prompts, group=group, rows=prompts * group,
              prompt_len=prompt_len, new_tokens=new_tokens, first_call_s=first_s, seconds=seconds,
              seconds_all=times, tokens_per_s=expected / seconds,
              decode_steps=sampler.last_num_steps)


def weight_sync(c: ModelConfig, *, reps: int, tmp: str) -> dict[str, Any]:
  """Seconds per policy push into a JAX generation process, split (see the module docstring)."""
  policy = models.Transformer(c, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, param_dtype=jnp.float32)
  path = os.path.join(tmp, "policy")
  t0 = time.perf_counter()
  models.save_pretrained(policy, path, dtype=jnp.bfloat16)
  save_s = time.perf_counter() - t0
  print(f"sync: checkpoint written in {save_s:.1f} s; starting the generation process", flush=True)
  engine = make_engine("jax", path, options=dict(dtype="bfloat16"))
  print(f"sync: generation process ready in {engine.startup_s:.1f} s", flush=True)
  rows = []
  try:
    for rep in range(reps + 1):
      t0 = time.perf_counter()
      state = models.host_state_dict(policy, jnp.bfloat16)
      d2h = time.perf_counter() - t0
      engine.update_weights(state)
      s = engine.last_sync
      print(f"sync: push {rep}: device->host {d2h:.2f} s, " + ", ".join(
          f"{k} {v:.3g}" for k, v in s.items()), flush=True)
      if rep:  # the first push creates and maps the shared block
        rows.append(dict(device_to_host_s=d2h, shm_write_s=s["copy_s"], child_load_s=s["load_s"],
                         push_s=d2h + s["total_s"], bytes=s["bytes"]))
      del state
    startup_s = engine.startup_s
  finally:
    engine.close()
  med = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k != "bytes"}
  return dict(kind="sync", bytes=rows[0]["bytes"], tensors=len(models.expected_hf_keys(c)),
              checkpoint_save_s=save_s, engine_startup_s=startup_s, reps=rows, **med)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--models", default="qwen3-0.6b,qwen3-4b-base", help="generation presets")
  ap.add_argument("--prompts", default="8,32", help="prompts per call, comma-separated")
  ap.add_argument("--group", type=int, default=8, help="G samples per prompt")
  ap.add_argument("--prompt-len", type=int, default=256)
  ap.add_argument("--new-tokens", type=int, default=1024)
  ap.add_argument("--reps", type=int, default=3)
  ap.add_argument("--sync-model", default="qwen3-4b-base", help="'' skips the weight sync")
  ap.add_argument("--sync-reps", type=int, default=3)
  ap.add_argument("--tmp", default=None,
                  help="where the sync's checkpoint goes (default: a temp dir)")
  ap.add_argument("--out", default=None, help="append each result as a JSON line here")
  args = ap.parse_args(argv)
  args.models = [m for m in args.models.split(",") if m]
  for m in args.models + ([args.sync_model] if args.sync_model else []):
    get_preset(m)
  try:
    args.prompts = [int(p) for p in args.prompts.split(",") if p]
  except ValueError:
    raise SystemExit(f"--prompts={args.prompts!r}: expected comma-separated integers") from None
  for name in ("group", "prompt_len", "new_tokens", "reps", "sync_reps"):
    if getattr(args, name) < 1:
      raise SystemExit(f"--{name.replace('_', '-')}={getattr(args, name)}: must be >= 1")
  return args


def main(argv: Sequence[str] | None = None) -> None:
  args = parse_args(argv)
  print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}", flush=True)
  results = []

  def record(r: dict[str, Any]) -> None:
    results.append(r)
    print(json.dumps(r), flush=True)
    if args.out:
      with open(args.out, "a") as f:
        f.write(json.dumps(r) + "\n")

  for name in args.models:
    for p in args.prompts:
      try:
        r = generation(get_preset(name), p, prompt_len=args.prompt_len, group=args.group,
                       new_tokens=args.new_tokens, reps=args.reps)
      except Exception as e:  # pylint: disable=broad-except  (an OOM is a result of its row)
        r = dict(kind="generate", prompts=p, error=f"{type(e).__name__}: {str(e)[:1500]}")
      record(dict(model=name, **r))
  if args.sync_model:
    tmp = args.tmp or tempfile.mkdtemp(prefix="bench_gpu_rollout_")
    try:
      record(dict(model=args.sync_model,
                  **weight_sync(get_preset(args.sync_model), reps=args.sync_reps, tmp=tmp)))
    finally:
      if not args.tmp:
        shutil.rmtree(tmp, ignore_errors=True)
  print("\nmodel          kind      what                                   seconds   tokens/s")
  for r in results:
    if "error" in r:
      print(f"{r['model']:14s} {r['kind']:9s} ERROR {r['error'].splitlines()[0][:80]}")
    elif r["kind"] == "generate":
      print(f"{r['model']:14s} generate  {r['prompts']:3d} prompts x G={r['group']} x "
            f"{r['new_tokens']} new tokens   {r['seconds']:8.2f} {r['tokens_per_s']:10.0f}")
    else:
      print(f"{r['model']:14s} sync      {r['bytes'] / 1e9:.2f} GB push: d2h "
            f"{r['device_to_host_s']:.2f} + shm {r['shm_write_s']:.2f} + child load "
            f"{r['child_load_s']:.2f} = {r['push_s']:.2f} s")


if __name__ == "__main__":
  main()
