"""Attention over packed rows: forward + backward time and XLA's FLOP count per implementation.

Implementations (`disa_jax.models.attention_dispatch`):
- ``dense``: today's path, `attention.gqa_attention` on the `[B, T, T]` mask (causal query blocks,
  or ``--chunk`` query chunks under `jax.checkpoint`, as the paper configs' attention_chunk=1024);
- ``xla``: the block-sparse XLA path (causal blocks, the band at the segment length, the same
  ``--chunk``);
- ``pallas``: the Pallas kernels (segment-aware block skipping at run time). On a CPU they only
  run in the interpreter, which is no speed figure: skipped there;
- ``cudnn`` (``--gpu`` only): cuDNN flash attention on the packed layout.

Each case is one packed row layout: T tokens in S equal segments (S = 1: one sequence). Every
implementation is checked against ``dense`` first (largest relative error of the output and the
q / k / v gradients). Timing: every implementation is jitted and run twice, then ``--reps``
rounds time each once, in an order that rotates by one every round (alternating blocks); the
median, min and max seconds are printed, and the ratio to ``dense`` within each round (median,
min-max). The 1-, 5- and 15-minute load averages are printed before and after (this machine is
shared). FLOPs: ``jit(fwd+bwd).lower().compile().cost_analysis()['flops']`` (a custom call such
as cuDNN's or a Triton kernel counts as 0 there), and the useful FLOPs of the causal segments
(4 H x N x sum over segments of s (s + 1) / 2 per matmul pair, forward + 2.5x for the backward).

Usage:
  python benchmarks/bench_attention.py [--reps 7] [--chunk 0] [--out FILE.jsonl]
  python benchmarks/bench_attention.py --gpu      # Qwen3-4B heads, bf16, writes
                                                  # benchmarks/results/bench_attention_gpu.jsonl
No GPU figures are claimed by this script's author: the GPU case is for a session with a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

if __name__ == "__main__":
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from disa_jax.models import attention as A  # noqa: E402
from disa_jax.models import attention_dispatch  # noqa: E402

# name -> (batch, query heads, kv heads, head dim, dtype, [(T, segments), ...], implementations)
PRESETS = {
    "cpu": (1, 8, 2, 64, "float32", [(1024, 1), (1024, 8), (2048, 1), (2048, 8)],
            ("dense", "xla")),
    "gpu": (1, 32, 8, 128, "bfloat16",
            [(2048, 1), (8192, 1), (8192, 4), (16384, 1), (16384, 8)],
            ("dense", "xla", "pallas", "cudnn")),
}


def parse_args(argv=None) -> argparse.Namespace:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--gpu", action="store_true", help="the GPU preset (Qwen3-4B heads, bf16)")
  ap.add_argument("--reps", type=int, default=7, help="timed rounds per case")
  ap.add_argument("--chunk", type=int, default=None,
                  help="attention_chunk of 'dense' and 'xla' (default: 0 on a CPU, 1024 on a GPU)")
  ap.add_argument("--impls", default=None, help="comma-separated subset of the preset's")
  ap.add_argument("--out", default=None, help="JSON lines file (default with --gpu: "
                  "benchmarks/results/bench_attention_gpu.jsonl)")
  args = ap.parse_args(argv)
  args.preset = PRESETS["gpu" if args.gpu else "cpu"]
  if args.chunk is None:
    args.chunk = 1024 if args.gpu else 0
  if args.out is None and args.gpu:
    args.out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                            "bench_attention_gpu.jsonl")
  impls = args.preset[6]
  if args.impls:
    wanted = [i.strip() for i in args.impls.split(",") if i.strip()]
    bad = sorted(set(wanted) - set(impls))
    if bad:
      raise SystemExit(f"--impls={args.impls!r}: {bad} not in this preset's {impls}")
    impls = tuple(wanted)
  args.impls = impls if "dense" in impls else ("dense",) + impls  # the baseline of the ratios
  if args.reps < 1:
    raise SystemExit(f"--reps={args.reps}: must be >= 1")
  return args


def case_inputs(t: int, segments: int, preset, seed: int = 0):
  """q, k, v, loss weights and the `[1, T]` segment ids of T tokens in equal segments."""
  b, n, kv, h, dtype = preset[:5]
  rng = np.random.default_rng(seed)
  q, k, v, w = (jnp.asarray(rng.normal(size=s), dtype)
                for s in ((b, t, n, h), (b, t, kv, h), (b, t, kv, h), (b, t, n, h)))
  seg = np.repeat(np.arange(1, segments + 1), -(-t // segments))[:t]
  return q, k, v, w, jnp.asarray(np.broadcast_to(seg, (b, t)), jnp.int32)


def step_fn(impl: str, *, chunk: int, window: int, segments: int) -> Callable:
  """Jitted (q, k, v, weights, segment ids) -> (loss, (dq, dk, dv))."""
  def loss(q, k, v, w, seg):
    out = attention_dispatch.attend(q, k, v, A.packed_layout(seg), impl=impl,
                                    chunk=chunk if impl in ("dense", "xla") else 0,
                                    window=window if impl == "xla" else 0,
                                    max_segments=segments)
    return jnp.sum(out.astype(jnp.float32) * w)
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def compiled_flops(fn, *args) -> float | None:
  cost = fn.lower(*args).compile().cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return None if not cost or "flops" not in cost else float(cost["flops"])


def useful_flops(t: int, segments: int, preset) -> float:
  """Forward + backward matmul FLOPs of the causal segments only (backward = 2.5 x forward)."""
  _, n, _, h = preset[:4]
  s = -(-t // segments)
  pairs = segments * s * (s + 1) / 2
  return 3.5 * 4 * n * h * pairs * preset[0]


def rel_err(got, want) -> float:
  errs = []
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    errs.append(float(np.abs(a - b).max() / max(1.0, np.abs(b).max())))
  return max(errs)


def time_case(fns: dict[str, Callable], args: tuple, reps: int) -> dict[str, list[float]]:
  """Seconds per call of each function, rounds in a rotating order (alternating blocks)."""
  names = list(fns)
  for name in names:  # compile + warm up
    for _ in range(2):
      jax.block_until_ready(fns[name](*args))
  times: dict[str, list[float]] = {name: [] for name in names}
  for r in range(reps):
    for name in names[r % len(names):] + names[:r % len(names)]:
      t0 = time.perf_counter()
      jax.block_until_ready(fns[name](*args))
      times[name].append(time.perf_counter() - t0)
  return times


def run_case(t: int, segments: int, args: argparse.Namespace) -> list[dict[str, Any]]:
  preset = args.preset
  window = -(-t // segments) if segments > 1 else 0
  inputs = case_inputs(t, segments, preset)
  fns = {impl: step_fn(impl, chunk=args.chunk, window=window, segments=segments)
         for impl in args.impls}
  want = fns["dense"](*inputs)
  errors = {impl: rel_err(fn(*inputs), want) for impl, fn in fns.items()}
  flops = {impl: compiled_flops(fn, *inputs) for impl, fn in fns.items()}
  times = time_case(fns, inputs, args.reps)
  base = times["dense"]
  records = []
  for impl in args.impls:
    ratios = [d / x for d, x in zip(base, times[impl])]
    records.append(dict(
        kind="attention", impl=impl, t=t, segments=segments, window=window, chunk=args.chunk,
        batch=preset[0], heads=preset[1], kv_heads=preset[2], head_dim=preset[3],
        dtype=preset[4], seconds=statistics.median(times[impl]), seconds_min=min(times[impl]),
        seconds_max=max(times[impl]), speedup_vs_dense=statistics.median(ratios),
        speedup_min=min(ratios), speedup_max=max(ratios), max_rel_err_vs_dense=errors[impl],
        xla_flops=flops[impl], useful_flops=useful_flops(t, segments, preset),
        backend=jax.default_backend(), device=jax.devices()[0].device_kind, jax=jax.__version__))
  return records


def print_records(records: list[dict[str, Any]]) -> None:
  for r in records:
    flops = "n/a" if r["xla_flops"] is None else f"{r['xla_flops'] / 1e9:.2f}"
    print(f"  T={r['t']:>6} seg={r['segments']:>2} {r['impl']:>7}: {r['seconds'] * 1e3:9.1f} ms "
          f"({r['seconds_min'] * 1e3:.1f}-{r['seconds_max'] * 1e3:.1f})  "
          f"x{r['speedup_vs_dense']:.2f} vs dense ({r['speedup_min']:.2f}-{r['speedup_max']:.2f})  "
          f"XLA GFLOP {flops}  useful {r['useful_flops'] / 1e9:.2f}  "
          f"err {r['max_rel_err_vs_dense']:.1e}", flush=True)


def main(argv=None) -> None:
  args = parse_args(argv)
  b, n, kv, h, dtype, cases, _ = args.preset
  print(f"JAX {jax.__version__} on {jax.default_backend()} ({jax.devices()[0].device_kind}); "
        f"B={b}, {n} heads / {kv} kv heads, head_dim {h}, {dtype}, chunk {args.chunk}, "
        f"{args.reps} rounds; implementations {args.impls}", flush=True)
  print(f"load average before: {os.getloadavg()}", flush=True)
  records = []
  for t, segments in cases:
    case = run_case(t, segments, args)
    print_records(case)
    records += case
  print(f"load average after: {os.getloadavg()}")
  if args.out:
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
      for r in records:
        f.write(json.dumps(r) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
