"""The policy's weight push into a JAX generation process: today's per-tensor path against the flat
push (issue 41), in the same run, alternating blocks.

The trainer's policy (random weights of a preset's shapes, float32 parameters, ``--layers`` of them
or the preset's) is pushed as ``--dtype`` into a `RemoteEngine` (spawned JAX sampler, same
dtype) started from a checkpoint of the same shapes. Each repetition runs one push of each path:

* old: `models.host_state_dict` (per tensor: device -> host in float32, cast in NumPy, transposed to
  the HF layout), the copy of ~400 arrays into shared memory, `load_hf_state_dict` in the child
  (transposed back, restacked, then host -> device);
* flat: `flat_weights.export` (cast and concatenated on the device, one device -> host copy per
  bucket), a ``--copy-threads`` copy of the buckets into shared memory, `flat_weights.load` in the
  child (one host -> device copy per bucket, a jitted split into the sampler's own layouts).

Parts: device -> host (the export), shm (`RemoteEngine.last_sync['copy_s']`), child load
(``load_s``), push (export + the whole ``update_weights`` call); medians and min-max over
``--reps`` after one untimed repetition (compilation; the first push creates and maps the block),
in GB/s of the pushed bytes too. ``--paths`` picks the paths (and `flat_pinned`: the flat export
through page-locked host memory); ratios are against the first. At the end the engine, holding the
last push, samples the greedy tokens it sampled from the checkpoint loaded directly.

Both processes run with XLA_PYTHON_CLIENT_PREALLOCATE=false (unless set): two JAX processes may
share one GPU.

Usage (GPU, one command): python benchmarks/bench_weight_push.py --model qwen3-4b-base --layers 0
    --out benchmarks/results/weight_push_<gpu>.jsonl
CPU: python benchmarks/bench_weight_push.py --model qwen3-1.7b --layers 4 (1.7B shapes, 4 of its
    28 layers: the whole model in float32 plus its copies does not fit a shared 23 GB machine).
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

from disa_jax import models, testing  # noqa: E402
from disa_jax.models.config import get_preset  # noqa: E402
from disa_jax.rollout import SamplingParams, flat_weights, make_engine  # noqa: E402

PARTS = ("device_to_host_s", "shm_s", "child_load_s", "push_s")


PATHS = ("old", "flat", "flat_pinned")


def _push(engine, policy, path: str, dtype: Any) -> dict[str, float]:
  """One push of ``path`` (`PATHS`); its parts in seconds."""
  t0 = time.perf_counter()
  if path == "old":
    weights = models.host_state_dict(policy, dtype)
  else:
    weights = flat_weights.export(policy, dtype, assemble="auto",
                                  host_memory="pinned" if path == "flat_pinned" else "pageable")
  d2h = time.perf_counter() - t0
  engine.update_weights(weights)
  s = engine.last_sync
  return dict(device_to_host_s=d2h, shm_s=s["copy_s"], child_load_s=s["load_s"],
              push_s=d2h + s["total_s"], bytes=s["bytes"])


def _greedy(engine, vocab: int) -> list[list[int]]:
  prompts = [list(range(3, 11)), list(range(20, 25))]
  out = engine.generate([[t % vocab for t in p] for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=8))
  return [per[0].token_ids.tolist() for per in out]


def run(model: str, layers: int, dtype: str, reps: int, copy_threads: int, tmp: str,
        paths: Sequence[str] = ("old", "flat")) -> dict[str, Any]:
  """Both paths, alternating, on a policy of ``model``'s shapes (a preset or 'tiny'; ``layers``
  of them, 0 = all), pushed as ``dtype`` (see the module docstring)."""
  config = testing.tiny_config("qwen3", head_dim=32) if model == "tiny" else get_preset(model)
  if layers:
    config = config.replace(num_layers=layers)
  policy = models.Transformer(config, rngs=nnx.Rngs(0), dtype=jnp.dtype(dtype),
                              param_dtype=jnp.float32)
  path = os.path.join(tmp, "policy")
  t0 = time.perf_counter()
  models.save_pretrained(policy, path, dtype=jnp.dtype(dtype))
  print(f"checkpoint written in {time.perf_counter() - t0:.1f} s", flush=True)
  engine = make_engine("jax", path, options=dict(dtype=dtype))
  engine.copy_threads = copy_threads
  rows: dict[str, list[dict[str, float]]] = {p: [] for p in paths}
  try:
    direct = _greedy(engine, config.vocab_size)  # the checkpoint's weights, loaded directly
    for rep in range(reps + 1):
      for name in (tuple(paths) if rep % 2 == 0 else tuple(reversed(paths))):
        r = _push(engine, policy, name, jnp.dtype(dtype))
        print(f"rep {rep} {name}: " + ", ".join(f"{k} {v:.3g}" for k, v in r.items()), flush=True)
        if rep:
          rows[name].append(r)
    same = _greedy(engine, config.vocab_size) == direct  # after the last push (`last_path`)
  finally:
    engine.close()
  out: dict[str, Any] = dict(kind="weight_push", paths=list(paths), model=model,
                             layers=config.num_layers,
                             dtype=dtype, copy_threads=copy_threads, reps=reps, last_path=name,
                             device=jax.devices()[0].device_kind, same_greedy_samples=same,
                             params=sum(int(np.prod(s)) for _, s in
                                        flat_weights.param_shapes(config)))
  for name, rs in rows.items():
    out[f"{name}_bytes"] = rs[0]["bytes"]
    for part in PARTS:
      xs = [r[part] for r in rs]
      out[f"{name}_{part}"] = statistics.median(xs)
      out[f"{name}_{part}_min_max"] = [min(xs), max(xs)]
      out[f"{name}_{part[:-2]}_gb_per_s"] = rs[0]["bytes"] / statistics.median(xs) / 1e9
  for name in paths[1:]:
    out[f"speedup_push_{name}"] = out[f"{paths[0]}_push_s"] / out[f"{name}_push_s"]
  return out


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--model", default="qwen3-1.7b",
                  help="preset whose shapes the policy has ('tiny': a CPU dry run)")
  ap.add_argument("--layers", type=int, default=4, help="0 = the preset's")
  ap.add_argument("--dtype", default="bfloat16", help="pushed and engine dtype")
  ap.add_argument("--reps", type=int, default=3)
  ap.add_argument("--copy-threads", type=int, default=min(8, os.cpu_count() or 1))
  ap.add_argument("--tmp", default=None, help="where the checkpoint goes (default: a temp dir)")
  ap.add_argument("--paths", default="old,flat",
                  help=f"comma-separated, of {PATHS}; ratios are against the first")
  ap.add_argument("--out", default=None, help="append the result as a JSON line here")
  args = ap.parse_args(argv)
  if args.model != "tiny":
    get_preset(args.model)
  for name in ("reps", "copy_threads"):
    if getattr(args, name) < 1:
      raise SystemExit(f"--{name.replace('_', '-')}={getattr(args, name)}: must be >= 1")
  args.paths = [p for p in args.paths.split(",") if p]
  bad = [p for p in args.paths if p not in PATHS]
  if bad or not args.paths or len(set(args.paths)) != len(args.paths):
    raise SystemExit(f"--paths={','.join(args.paths)}: distinct names of {PATHS} expected")
  if args.layers < 0:
    raise SystemExit(f"--layers={args.layers}: must be >= 0")
  return args


def main(argv: Sequence[str] | None = None) -> None:
  args = parse_args(argv)
  print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, load {os.getloadavg()}",
        flush=True)
  tmp = args.tmp or tempfile.mkdtemp(prefix="bench_weight_push_")
  try:
    r = run(args.model, args.layers, args.dtype, args.reps, args.copy_threads, tmp, args.paths)
  finally:
    if not args.tmp:
      shutil.rmtree(tmp, ignore_errors=True)
  print(json.dumps(r), flush=True)
  if args.out:
    with open(args.out, "a") as f:
      f.write(json.dumps(r) + "\n")
  paths = r["paths"]
  print(f"\n{r['model']} ({r['layers']} layers, {r['params'] / 1e9:.2f} B params) pushed as "
        f"{r['dtype']}: {r[f'{paths[-1]}_bytes'] / 1e9:.2f} GB; medians (min-max) over "
        f"{r['reps']} reps; GB/s in brackets")
  print(f"{'part':16s} " + " ".join(f"{p:>30s}" for p in paths))
  for part in PARTS:
    cells = [f"{r[f'{p}_{part}']:.3f} ({r[f'{p}_{part}_min_max'][0]:.3f}-"
             f"{r[f'{p}_{part}_min_max'][1]:.3f}) [{r[f'{p}_{part[:-2]}_gb_per_s']:.1f}]"
             for p in paths]
    print(f"{part[:-2]:16s} " + " ".join(f"{c:>30s}" for c in cells))
  for p in paths[1:]:
    print(f"push speed-up of {p} over {paths[0]}: {r[f'speedup_push_{p}']:.2f}x")
  print(f"greedy samples after the last push ({r['last_path']}) equal the directly loaded "
        f"checkpoint's: {r['same_greedy_samples']}")

if __name__ == "__main__":
  main()
