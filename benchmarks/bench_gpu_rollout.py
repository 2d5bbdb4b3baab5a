"""Generation with the JAX sampler on one GPU: the ragged cache against the dense reference
(issues 31 and 41).

`JaxSampler` in this process on a preset with random bf16 weights (no download): ``--prompts``
prompts of ``--prompt-len`` random tokens, G = ``--group`` samples each, exactly ``--new-tokens``
new tokens per sample (temperature 1, no stop token), for each ``--layouts`` entry
('ragged': continuous batching on the head-major ragged cache, `disa_jax.rollout.continuous`,
once per ``--decode-attention`` entry: 'xla', the reference loop over every block, 'xla_live',
the loop over the live blocks, or 'pallas', one kernel for every layer,
`disa_jax.models.decode_attention_pallas`; 'dense': today's reference path). Tokens/s = P * G *
new_tokens / the wall time of `generate`
(host packing and unpacking included), median of ``--reps`` calls after one untimed call
(compilation); ms per decode step = that time / new_tokens. Each ragged row also carries the
compiled program's memory (`JaxSampler.compiled_memory`: arguments, temporaries, the KV cache)
and every row the device's peak bytes in use.

The weight push is measured by `benchmarks/bench_weight_push.py` (today's path against the flat
push, in the same run).

Usage (GPU, one command; ~6 min on an H200):
    python benchmarks/bench_gpu_rollout.py --models qwen3-4b-base --prompts 8,32 \
        --layouts ragged,dense --new-tokens 1024 --reps 1 --out benchmarks/results/gpu_rollout_<gpu>.jsonl
CPU dry run: --models tiny --prompts 2 --group 2 --prompt-len 8 --new-tokens 16 --reps 1
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
import statistics  # noqa: E402
import time  # noqa: E402
from typing import Any, Sequence  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from disa_jax import models, testing  # noqa: E402
from disa_jax.models.config import ModelConfig, get_preset  # noqa: E402
from disa_jax.rollout import SamplingParams  # noqa: E402
from disa_jax.models.decode_attention import IMPLS as DECODE_IMPLS  # noqa: E402
from disa_jax.rollout.jax_sampler import CACHE_LAYOUTS, JaxSampler  # noqa: E402


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
  rng = np.random.default_rng(seed)
  return [rng.integers(3, vocab, length).tolist() for _ in range(n)]


def model_config(name: str) -> ModelConfig:
  """A preset, or 'tiny' (`testing.tiny_config`, for a CPU dry run)."""
  return testing.tiny_config("qwen3", head_dim=32) if name == "tiny" else get_preset(name)


def _peak_bytes() -> int | None:
  stats = jax.devices()[0].memory_stats() or {}
  return stats.get("peak_bytes_in_use")


def generation(c: ModelConfig, prompts: int, *, layout: str, prompt_len: int, group: int,
               new_tokens: int, reps: int, decode_attention: str = "xla",
               dtype: Any = jnp.bfloat16) -> dict[str, Any]:
  """Tokens/s of `JaxSampler.generate` (see the module docstring)."""
  model = models.Transformer(c, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=dtype,
                             options=models.ModelOptions(decode_attention=decode_attention))
  sampler = JaxSampler(model, max_batch_size=max(256, prompts * group), cache_layout=layout)
  out: dict[str, Any] = dict(kind="generate", layout=layout, prompts=prompts, group=group,
                             rows=prompts * group, prompt_len=prompt_len, new_tokens=new_tokens,
                             decode_attention=decode_attention if layout == "ragged" else "-")
  if layout == "ragged":
    memory, cache = sampler.compiled_memory(prompts, group, prompt_len, new_tokens)
    out.update(kv_cache_bytes=cache, program_argument_bytes=memory.argument_size_in_bytes,
               program_temp_bytes=memory.temp_size_in_bytes,
               program_alias_bytes=memory.alias_size_in_bytes)
  batch = random_prompts(prompts, prompt_len, c.vocab_size)
  t0 = time.perf_counter()
  sampler.generate(batch, SamplingParams(n=group, max_tokens=new_tokens, seed=0))
  first_s = time.perf_counter() - t0
  expected = prompts * group * new_tokens
  times = []
  for rep in range(reps):
    t0 = time.perf_counter()
    got = sampler.generate(batch, SamplingParams(n=group, max_tokens=new_tokens, seed=rep + 1))
    times.append(time.perf_counter() - t0)
    got = sum(len(s.token_ids) for per in got for s in per)
    if got != expected:
      raise RuntimeError(f"generated {got} tokens, expected {expected}")
  sampler.close()
  seconds = statistics.median(times)
  out.update(first_call_s=first_s, seconds=seconds, seconds_all=times,
             tokens_per_s=expected / seconds, ms_per_step=1e3 * seconds / new_tokens,
             decode_steps=sampler.last_num_steps, peak_bytes=_peak_bytes())
  return out


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--models", default="qwen3-0.6b,qwen3-4b-base",
                  help="presets (or 'tiny'), comma-separated")
  ap.add_argument("--prompts", default="8,32", help="prompts per call, comma-separated")
  ap.add_argument("--layouts", default="ragged,dense", help=f"of {CACHE_LAYOUTS}, in this order")
  ap.add_argument("--decode-attention", default="xla",
                  help=f"the ragged layout's decode attention, of {DECODE_IMPLS}, in this order")
  ap.add_argument("--group", type=int, default=8, help="G samples per prompt")
  ap.add_argument("--prompt-len", type=int, default=256)
  ap.add_argument("--new-tokens", type=int, default=1024)
  ap.add_argument("--reps", type=int, default=3)
  ap.add_argument("--out", default=None, help="append each result as a JSON line here")
  args = ap.parse_args(argv)
  args.models = [m for m in args.models.split(",") if m]
  for m in args.models:
    model_config(m)
  args.layouts = [x for x in args.layouts.split(",") if x]
  bad = [x for x in args.layouts if x not in CACHE_LAYOUTS]
  if bad:
    raise SystemExit(f"--layouts: {bad} not in {CACHE_LAYOUTS}")
  args.decode_attention = [x for x in args.decode_attention.split(",") if x]
  bad = [x for x in args.decode_attention if x not in DECODE_IMPLS]
  if bad or not args.decode_attention:
    raise SystemExit(f"--decode-attention: {bad or 'empty'} not in {DECODE_IMPLS}")
  try:
    args.prompts = [int(p) for p in args.prompts.split(",") if p]
  except ValueError:
    raise SystemExit(f"--prompts={args.prompts!r}: expected comma-separated integers") from None
  for name in ("group", "prompt_len", "new_tokens", "reps"):
    if getattr(args, name) < 1:
      raise SystemExit(f"--{name.replace('_', '-')}={getattr(args, name)}: must be >= 1")
  return args


def main(argv: Sequence[str] | None = None) -> None:
  args = parse_args(argv)
  print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}", flush=True)
  results = []
  for name in args.models:
    for p in args.prompts:
      variants = [(x, a) for x in args.layouts
                  for a in (args.decode_attention if x == "ragged" else ["-"])]
      for layout, attn in variants:
        try:
          r = generation(model_config(name), p, layout=layout, prompt_len=args.prompt_len,
                         group=args.group, new_tokens=args.new_tokens, reps=args.reps,
                         decode_attention="xla" if attn == "-" else attn)
        except Exception as e:  # pylint: disable=broad-except  (an OOM is a result of its row)
          r = dict(kind="generate", layout=layout, decode_attention=attn, prompts=p,
                   rows=p * args.group, error=f"{type(e).__name__}: {str(e)[:1500]}",
                   peak_bytes=_peak_bytes())
        r = dict(model=name, **r)
        results.append(r)
        print(json.dumps(r), flush=True)
        if args.out:
          with open(args.out, "a") as f:
            f.write(json.dumps(r) + "\n")
  print("\nmodel          layout  attn    rows  new tokens  seconds   tokens/s  ms/step  peak GiB")
  for r in results:
    peak = f"{r['peak_bytes'] / 2**30:8.1f}" if r.get("peak_bytes") else "       -"
    if "error" in r:
      print(f"{r['model']:14s} {r['layout']:6s} {r['decode_attention']:6s} {r['rows']:5d}  ERROR "
            f"{r['error'].splitlines()[0][:70]} {peak}")
    else:
      print(f"{r['model']:14s} {r['layout']:6s} {r['decode_attention']:6s} {r['rows']:5d} "
            f"{r['new_tokens']:11d} "
            f"{r['seconds']:8.2f} {r['tokens_per_s']:10.0f} {r['ms_per_step']:8.2f} {peak}")


if __name__ == "__main__":
  main()
