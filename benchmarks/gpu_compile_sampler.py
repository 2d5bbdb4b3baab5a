"""The JAX sampler's GPU programs, compiled on this machine for a GPU that is not here (issue 66).

For a named card (`disa_jax.parallel.gpu_compile`: h100_sxm, h200, a100_sxm_80) the sampler's own
programs are lowered on abstract inputs (`JaxSampler.lower_programs`, `flat_weights.
lower_programs`: the code the sampler runs, nothing built here) and compiled by XLA:GPU, never run:

- ``prefill``: one admission of the continuous-batching loop (``unit`` rows prefilled into free
  slots, `continuous.prefill_step`);
- ``decode``: one decode step of every slot (`continuous.decode_step`), once per
  ``--decode-attention`` entry ('xla': the loop over every cache block; 'pallas': the kernel;
  'xla_live': the old live-bounds loop, for comparison);
- ``kernel``: the Pallas decode kernel alone at the model's shapes (its compile time, the figure
  the CI check bounds);
- ``push``: the flat weight push's per-bucket programs (the trainer's cast + concatenate, the
  engine's split), summed over the buckets.

Each program reports compile seconds, per-device argument / output / alias / temp bytes against the
card's memory, matmul FLOPs per run, largest buffers, custom calls, while loops whose trip count
depends on device data (a GPU reads their predicate back to the host every iteration), and the
Triton kernels in the lowered module (``triton_calls``: one for a scanned layer stack, L when the
layer is baked into each kernel). A decode step also gets a lower bound on its time: the larger of
its FLOPs at the card's bf16 peak and the bytes it must read at HBM bandwidth (the weights, plus
the KV cache: every position for 'xla', the live ones on average for 'pallas' and 'xla_live', i.e.
prompt + half the new tokens), and the tokens/s that bound allows at one token per slot per step.
When the request's slots do not fit the card, the largest power-of-two slot count whose weights +
KV cache fit 90% of its memory is compiled too (``--fit-slots``; the request then runs in waves).

Usage (needs JAX's CUDA plugin: `gpu_compile.compile_env`; the script re-runs itself with it):
  python benchmarks/gpu_compile_sampler.py --card h200 --new-tokens 1024,8192 \\
      --json benchmarks/results/gpu_compile_sampler_h200.json      # ~6 min on 2 cores
  python benchmarks/gpu_compile_sampler.py --card h100_sxm --layers 2 --new-tokens 1024 \\
      --decode-attention xla,pallas --no-push                        # the CI shape
"""
from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # before JAX is imported: CPU client, abstract CUDA devices
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  _ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from typing import Any, Sequence  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

from disa_jax import models  # noqa: E402
from disa_jax.models import decode_attention_pallas  # noqa: E402
from disa_jax.models.decode_attention import IMPLS  # noqa: E402
from disa_jax.models.kv_bits import bits_dtype  # noqa: E402
from disa_jax.parallel import gpu_compile  # noqa: E402
from disa_jax.rollout import continuous, flat_weights  # noqa: E402
from disa_jax.rollout.jax_sampler import JaxSampler  # noqa: E402

from bench_gpu_rollout import model_config  # noqa: E402  (this directory: a preset or 'tiny')

TRITON_CALL = "__gpu$xla.gpu.triton"
_RERUN = "DISA_GPU_COMPILE_RERUN"
FIT_FRACTION = 0.9  # of the card's memory, for weights + KV cache when choosing --fit-slots


@dataclasses.dataclass(frozen=True)
class Request:
  """One sampler request's shape: ``rows`` = prompts x group rows on ``slots`` slots."""
  rows: int
  group: int
  prompt_len: int
  new_tokens: int
  slots: int

  @property
  def cache_len(self) -> int:
    return self.prompt_len + self.new_tokens


def _sharding(card: gpu_compile.Card) -> NamedSharding:
  devices = gpu_compile.topology_devices(card, "1x1x1")
  return NamedSharding(Mesh(np.array(devices[:1]), ("x",)), PartitionSpec())


def abstract_sampler(config: models.ModelConfig, impl: str, slots: int) -> JaxSampler:
  """The sampler on an abstract bf16 model (scanned layers, as on a GPU)."""
  model = nnx.eval_shape(lambda: models.Transformer(
      config, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16,
      options=models.ModelOptions(layer_loop="scan", decode_attention=impl)))
  return JaxSampler(model, max_batch_size=slots, cache_layout="ragged")


def triton_calls(lowered: jax.stages.Lowered) -> int:
  """Triton kernel call sites in the lowered module (before XLA: one per traced pallas_call)."""
  return lowered.as_text().count(TRITON_CALL)


def _cpu_s() -> float:
  """CPU seconds of this process and its finished children (a compile's, on a shared machine:
  its wall time also counts the other processes)."""
  t = os.times()
  return t.user + t.system + t.children_user + t.children_system


def _record(name: str, lowered: Any, card: gpu_compile.Card, **extra: Any) -> dict[str, Any]:
  calls = triton_calls(lowered)
  t0 = _cpu_s()
  report = gpu_compile.compile_report(name, lowered, card, "1x1x1")
  out = report.to_json()
  out.update(compile_cpu_s=round(_cpu_s() - t0, 2), triton_calls=calls, **extra)
  print(gpu_compile.summary_line(report), f"; triton call sites {calls}", flush=True)
  return out


def decode_floor(record: dict[str, Any], *, card: gpu_compile.Card, impl: str, req: Request,
                 weight_bytes: int, cache_bytes: int) -> dict[str, float]:
  """Lower bound on one decode step (module docstring)."""
  live = 1.0 if impl == "xla" else (req.prompt_len + req.new_tokens / 2) / req.cache_len
  read = weight_bytes + live * cache_bytes
  memory_s, compute_s = read / card.hbm_bytes_per_s, record["dot_flops"] / card.bf16_flops_per_s
  bound = max(memory_s, compute_s)
  return dict(floor_read_bytes=read, floor_memory_ms=1e3 * memory_s,
              floor_compute_ms=1e3 * compute_s, floor_ms=1e3 * bound,
              floor_tokens_per_s=req.slots / bound)


def kernel_record(config: models.ModelConfig, req: Request, block: int, card: gpu_compile.Card,
                  sharding: Any) -> dict[str, Any]:
  """The Pallas decode kernel alone (with its cache write) at the model's shapes."""
  b, k, h, s = req.slots, config.num_kv_heads, config.head_dim, req.cache_len
  sds = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
  cache = sds((config.num_layers, b, k, s, h), bits_dtype(jnp.bfloat16))
  fn = jax.jit(lambda q, kn, vn, kc, vc, layer, write, start:
               decode_attention_pallas.pallas_ragged_attention(
                   q, kn, vn, kc, vc, layer, write, start, block, "bfloat16"),
               donate_argnums=(3, 4))
  lowered = fn.lower(sds((b, 1, config.num_heads, h), jnp.bfloat16),
                     sds((b, k, h), jnp.bfloat16), sds((b, k, h), jnp.bfloat16), cache, cache,
                     sds((), jnp.int32), sds((b,), jnp.int32), sds((b,), jnp.int32))
  return _record("kernel", lowered, card, block=block,
                 kernel_block=min(block, decode_attention_pallas.KERNEL_BLOCK))


def sampler_records(config: models.ModelConfig, model_name: str, req: Request,
                    impls: Sequence[str], card: gpu_compile.Card, sharding: Any, *,
                    kernel: bool, prefill: bool = True) -> list[dict[str, Any]]:
  """prefill (once), decode per impl, and the kernel, for one request shape."""
  records = []
  common = dict(model=model_name, layers=config.num_layers, rows=req.rows, slots=req.slots,
                prompt_len=req.prompt_len, new_tokens=req.new_tokens)
  for i, impl in enumerate(impls):
    sampler = abstract_sampler(config, impl, req.slots)
    # The request's shapes as the sampler pads them (its buckets): the cache the programs hold.
    key, _, _, padded = sampler.ragged_plan(req.rows, req.group, req.prompt_len, req.new_tokens)
    shaped = dataclasses.replace(req, prompt_len=padded, new_tokens=key[1])
    cache_bytes = continuous.cache_bytes(config, req.slots, shaped.cache_len, jnp.bfloat16)
    weight_bytes = sum(math.prod(x.shape) * x.dtype.itemsize
                       for x in jax.tree.leaves(nnx.state(sampler.model)))
    programs = ("prefill", "decode") if i == 0 and prefill else ("decode",)
    lowered = sampler.lower_programs(req.rows // req.group, req.group, req.prompt_len,
                                     req.new_tokens, sharding=sharding, programs=programs)
    for name, low in lowered.items():
      rec = _record(f"{name}[{impl}]" if name == "decode" else name, low, card, program=name,
                    decode_attention=impl if name == "decode" else "-",
                    kv_cache_bytes=cache_bytes, weight_bytes=weight_bytes, **common)
      if name == "decode":
        rec.update(decode_floor(rec, card=card, impl=impl, req=shaped,
                                weight_bytes=weight_bytes, cache_bytes=cache_bytes))
      records.append(rec)
    if impl == "pallas" and kernel:
      records.append(dict(kernel_record(config, shaped, key[4], card, sharding), **common))
  return records


def push_record(config: models.ModelConfig, model_name: str, card: gpu_compile.Card,
                sharding: Any) -> dict[str, Any]:
  """The flat push's programs (f32 trainer parameters -> bf16 buckets -> bf16 engine
  parameters), summed over the buckets; bytes: the largest bucket's program."""
  layout = flat_weights.FlatLayout(config, "bfloat16")
  out: dict[str, Any] = dict(program="push", model=model_name, buckets=len(layout.bucket_sizes),
                             flat_bytes=layout.nbytes)
  for side, dtype in (("export", jnp.float32), ("split", jnp.bfloat16)):
    lowered = flat_weights.lower_programs(layout, param_dtype=dtype, sharding=sharding)[side]
    reports = [gpu_compile.compile_report(f"push_{side}", low, card, "1x1x1") for low in lowered]
    out[side] = dict(compile_s=round(sum(r.compile_s for r in reports), 2),
                     max_total_bytes=max(r.total_bytes for r in reports),
                     fits=all(r.fits for r in reports),
                     data_dependent_loops=sum(len(r.facts.data_dependent_loops)
                                              for r in reports),
                     memory_floor_ms=1e3 * sum(r.argument_bytes + r.output_bytes
                                               for r in reports) / card.hbm_bytes_per_s)
    print(f"push {side}: {out[side]}", flush=True)
  return out


def fit_slots(config: models.ModelConfig, req: Request, card: gpu_compile.Card) -> int:
  """The largest power of two <= req.slots whose bf16 weights + KV cache fit `FIT_FRACTION` of
  the card (0: none)."""
  weights = 2 * sum(math.prod(s) for _, s in flat_weights.param_shapes(config))
  slots = req.slots
  while slots and weights + continuous.cache_bytes(config, slots, req.cache_len,
                                                   jnp.bfloat16) > FIT_FRACTION * card.memory_bytes:
    slots //= 2
  return slots


def passing(records: Sequence[dict[str, Any]], impls: Sequence[str]) -> list[str]:
  """The decode attentions whose every decode step and prefill fit the card and whose decode
  steps have no data-dependent loop (what `benchmarks/gpu_figures.sh` then measures)."""
  prefill_ok = all(r["fits"] for r in records if r.get("program") == "prefill")
  return [impl for impl in impls if prefill_ok and all(
      r["fits"] and not r["data_dependent_loops"] for r in records
      if r.get("program") == "decode" and r["decode_attention"] == impl)]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--card", default="h200", help=f"one of {sorted(gpu_compile.BF16_PEAK)}")
  ap.add_argument("--model", default="qwen3-4b-base", help="a preset, or 'tiny' (a dry run)")
  ap.add_argument("--layers", type=int, default=0, help="0 = the preset's")
  ap.add_argument("--rows", type=int, default=256)
  ap.add_argument("--group", type=int, default=8)
  ap.add_argument("--prompt-len", type=int, default=256)
  ap.add_argument("--new-tokens", default="1024", help="comma-separated")
  ap.add_argument("--decode-attention", default="xla,pallas", help=f"of {IMPLS[1:]}")
  ap.add_argument("--no-prefill", action="store_true")
  ap.add_argument("--no-push", action="store_true")
  ap.add_argument("--no-kernel", action="store_true")
  ap.add_argument("--no-fit-slots", action="store_true")
  ap.add_argument("--json", default=None, help="write the records here")
  ap.add_argument("--print-passing", action="store_true",
                  help="last line: the decode attentions that pass (`passing`), comma-separated")
  args = ap.parse_args(argv)
  args.new_tokens = [int(x) for x in args.new_tokens.split(",") if x]
  args.decode_attention = [x for x in args.decode_attention.split(",") if x]
  bad = [x for x in args.decode_attention if x not in IMPLS[1:]]
  if bad or not args.decode_attention:
    ap.error(f"--decode-attention {bad or '(empty)'}: expected some of {IMPLS[1:]}")
  if args.rows % args.group:
    ap.error(f"--rows {args.rows} must be a multiple of --group {args.group}")
  gpu_compile.load_card(args.card)
  model_config(args.model)
  return args


def run(args: argparse.Namespace) -> dict[str, Any]:
  card = gpu_compile.load_card(args.card)
  sharding = _sharding(card)
  config = model_config(args.model)
  if args.layers:
    config = dataclasses.replace(config, num_layers=args.layers)
  t0 = time.perf_counter()
  records = []
  for new in args.new_tokens:
    req = Request(args.rows, args.group, args.prompt_len, new, args.rows)
    slots = [req.slots]
    fitting = fit_slots(config, req, card)
    if not args.no_fit_slots and fitting not in (0, req.slots):
      slots.append(fitting)
    for n in slots:
      records += sampler_records(config, args.model, dataclasses.replace(req, slots=n),
                                 args.decode_attention, card, sharding,
                                 kernel=not args.no_kernel, prefill=not args.no_prefill)
  if not args.no_push:
    records.append(push_record(config, args.model, card, sharding))
  out = dict(card=card.name, device=card.device_name, memory_bytes=card.memory_bytes,
             hbm_bytes_per_s=card.hbm_bytes_per_s, bf16_flops_per_s=card.bf16_flops_per_s,
             jax=jax.__version__, seconds=round(time.perf_counter() - t0, 1), records=records)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(out, f, indent=1)
  return out


def main(argv: Sequence[str] | None = None) -> None:
  args = parse_args(argv)
  try:
    gpu_compile.topology_devices(gpu_compile.load_card(args.card), "1x1x1")
  except RuntimeError:  # the CUDA plugin must be found when JAX starts: run again with it
    if os.environ.get(_RERUN):
      raise
    env = dict(gpu_compile.compile_env(), **{_RERUN: "1"})
    raise SystemExit(subprocess.call([sys.executable, os.path.abspath(__file__)] + list(
        sys.argv[1:] if argv is None else argv), env=env))
  out = run(args)
  print(f"total {out['seconds']:.0f} s")
  if args.print_passing:
    print(",".join(passing(out["records"], args.decode_attention)))


if __name__ == "__main__":
  main()
