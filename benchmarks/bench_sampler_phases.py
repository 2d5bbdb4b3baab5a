"""Where the JAX sampler's generate time goes on a small request: prefill against decode steps, per
cache layout and decode attention, in one process.

`benchmarks/bench_stage3_vs_trl.py` times a whole RL step and its rollout phase; this script takes
that phase's request apart. Each variant is a `JaxSampler` on one tiny Qwen3 of the TRL peer's
shape (d = 128, 2 layers, 4 / 2 heads of 32, MLP 256) and answers the bench's request (8 prompts
of 17-24 tokens x 8 samples, temperature 1, no stop token) twice: with ``max_tokens`` = 1 (the
admissions' prefills and first tokens only) and with ``--new-tokens`` (the same plus N - 1 decode
steps). So

    per decode step = (median time at N - median time at 1) / (N - 1).

Blocks alternate over the variants (each ``--reps`` calls of each length after ``--warmup`` calls
that compile); wall time and this process's CPU time (`time.process_time`, all threads: steadier
than wall time when other jobs share the machine) are both kept, with medians and min-max per
variant and the ratio of each variant's medians to the first's. The load average is read before
each block.

Variants (``--variants``, comma-separated): ``<layout>`` or ``<layout>:<decode attention>``, with
layout 'ragged' (continuous batching, the default) or 'dense' (the reference), and the decode
attention one of `disa_jax.models.decode_attention.IMPLS` (default 'auto').

    python benchmarks/bench_sampler_phases.py [--variants dense,ragged,ragged:xla] [--blocks 3]
        [--reps 20] [--new-tokens 8] [--json-out F]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import numpy as np

from disa_jax import runtime, testing
from disa_jax.rollout import SamplingParams
from disa_jax.rollout.jax_sampler import JaxSampler

CLOCKS = ("wall", "cpu")


def parse_variant(text: str) -> tuple[str, str]:
  """'ragged' -> ('ragged', 'auto'); 'ragged:xla' -> ('ragged', 'xla')."""
  layout, _, attention = text.partition(":")
  return layout, attention or "auto"


def build_samplers(variants: list[str], seed: int = 0) -> dict[str, JaxSampler]:
  """One sampler per variant, each on its own copy of the same weights (the TRL peer's shape)."""
  out = {}
  for text in variants:
    layout, attention = parse_variant(text)
    model = testing.make_tiny_model(seed=seed, hidden_size=128, intermediate_size=256,
                                    head_dim=32)
    model.options = dataclasses.replace(model.options, decode_attention=attention)
    out[text] = JaxSampler(model, cache_layout=layout)
  return out


def request(vocab: int, prompts: int = 8, seed: int = 0) -> list[list[int]]:
  """The bench's request shape: ``prompts`` prompts of 17-24 tokens."""
  rng = np.random.default_rng(seed)
  return [rng.integers(3, vocab, size=int(rng.integers(17, 25))).tolist() for _ in range(prompts)]


def time_calls(sampler: JaxSampler, prompts, *, max_tokens: int, calls: int, first_seed: int
               ) -> dict[str, list[float]]:
  """Wall and CPU seconds of ``calls`` generate calls (8 samples per prompt, new seed each)."""
  out = {clock: [] for clock in CLOCKS}
  for i in range(calls):
    params = SamplingParams(n=8, temperature=1.0, max_tokens=max_tokens, seed=first_seed + i)
    wall, cpu = time.perf_counter(), time.process_time()
    sampler.generate(prompts, params)
    out["cpu"].append(time.process_time() - cpu)
    out["wall"].append(time.perf_counter() - wall)
  return out


def summarise(times: dict[str, dict[int, dict[str, list[float]]]], new_tokens: int) -> dict:
  """Per variant and clock (``times[variant][length][clock]``, variants in order): medians
  (min-max) at 1 and N tokens, the per-decode-step time, and each figure's ratio to the first
  variant's."""
  out = {}
  for name, by_len in times.items():
    out[name] = {}
    for clock in CLOCKS:
      one, full = runtime.spread(by_len[1][clock]), runtime.spread(by_len[new_tokens][clock])
      out[name][clock] = {"prefill_s": one, "generate_s": full, "n": len(by_len[new_tokens][clock]),
                          "per_decode_step_s": (full["median"] - one["median"]) / (new_tokens - 1)}
  base = out[next(iter(out))]
  for row in out.values():
    for clock in CLOCKS:
      r, b = row[clock], base[clock]
      r["ratio_to_first"] = {"prefill_s": r["prefill_s"]["median"] / b["prefill_s"]["median"],
                             "generate_s": r["generate_s"]["median"] / b["generate_s"]["median"],
                             "per_decode_step_s": r["per_decode_step_s"] / b["per_decode_step_s"]}
  return out


def _fmt(s: dict) -> str:
  return f"{s['median']:.4f} ({s['min']:.4f}-{s['max']:.4f})"


def report(summary: dict, new_tokens: int) -> list[str]:
  """The printed table: per variant and clock, the medians and the ratios to the first variant."""
  first = next(iter(summary))
  lines = []
  for clock in CLOCKS:
    lines.append(f"{clock} time, s: median (min-max); ratio = median / {first}'s")
    for name, row in summary.items():
      r, ratio = row[clock], row[clock]["ratio_to_first"]
      lines.append(
          f"  {name:<16} max_tokens 1: {_fmt(r['prefill_s'])}  max_tokens {new_tokens}: "
          f"{_fmt(r['generate_s'])}  per decode step {r['per_decode_step_s'] * 1e3:.3f} ms  "
          f"(ratios {ratio['prefill_s']:.2f}x, {ratio['generate_s']:.2f}x, "
          f"{ratio['per_decode_step_s']:.2f}x; n={r['n']})")
  return lines


def main(argv: list[str] | None = None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--variants", default="dense,ragged")
  ap.add_argument("--blocks", type=int, default=3)
  ap.add_argument("--reps", type=int, default=20)
  ap.add_argument("--warmup", type=int, default=3)
  ap.add_argument("--new-tokens", type=int, default=8)
  ap.add_argument("--json-out", default=None)
  args = ap.parse_args(argv)
  if args.new_tokens < 2:
    raise SystemExit(f"--new-tokens must be >= 2 (decode steps to time), got {args.new_tokens}")
  names = [v for v in args.variants.split(",") if v]
  samplers = build_samplers(names)
  prompts = request(next(iter(samplers.values())).vocab_size)
  print(f"8 prompts (17-24 tokens) x 8 samples; max_tokens 1 and {args.new_tokens}; variants "
        f"{names}; cpu count {os.cpu_count()}")
  times = {n: {k: {c: [] for c in CLOCKS} for k in (1, args.new_tokens)} for n in names}
  loads = []
  for block in range(args.blocks):
    loads.append(runtime.load_average())
    for name, sampler in samplers.items():
      for length in (1, args.new_tokens):
        time_calls(sampler, prompts, max_tokens=length, calls=args.warmup, first_seed=10 ** 6)
        got = time_calls(sampler, prompts, max_tokens=length, calls=args.reps,
                         first_seed=block * args.reps)
        for clock in CLOCKS:
          times[name][length][clock] += got[clock]
    print(f"block {block} (load {loads[-1]:.1f}) done", flush=True)
  summary = summarise(times, args.new_tokens)
  print("\n".join(report(summary, args.new_tokens)))
  print(f"load average before each block: {[round(x, 1) for x in loads]}; now "
        f"{runtime.load_average():.1f}")
  result = {"argv": argv, "variants": names, "loads": loads, "summary": summary, "times": times}
  if args.json_out:
    with open(args.json_out, "w") as f:
      json.dump(result, f, indent=1)
  return result


if __name__ == "__main__":
  main()
