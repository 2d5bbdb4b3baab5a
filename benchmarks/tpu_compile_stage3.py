"""The Stage 3 step compiled for a TPU slice this machine does not have (issue 66, the design card's
TPUs), through libtpu's compile-only path.

`jax.experimental.topologies.get_topology_desc(topology_name='v5e:2x2', platform='tpu')` gives the
abstract chips of a slice when libtpu is importable (no TPU, no driver; ``JAX_PLATFORMS=cpu``); the
trainer's own programs (`workflows.stage3_programs`, through `plan_memory.make_programs`: the
paper config's settings, FSDP over every chip, attention 'auto' = splash on a TPU) are lowered on
abstract inputs placed on them and compiled by XLA:TPU, never run. Per program (the micro step,
the optimizer step, the pi_old scoring pass): compile seconds, per-chip argument / output / alias
/ temp bytes against the chip's HBM, the custom calls (the splash kernels are Mosaic
``tpu_custom_call``s), collectives and loops whose trip count depends on device data
(`parallel.hlo_facts`), and the AdamW moments and bf16 reference also resident per chip.

Needs libtpu of the installed JAX's version (jax 0.10.2: ``libtpu==0.0.42.*``) importable, e.g.
``pip install --target DIR libtpu==0.0.42.1`` and DIR on ``PYTHONPATH``.

Usage (~10 min on 2 cores):
  PYTHONPATH=DIR:. python benchmarks/tpu_compile_stage3.py --slices v5e:2x2,v5p:2x2x1 \\
      --json benchmarks/results/tpu_compile_stage3.json
"""
from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # before JAX is imported: the CPU client; the chips are abstract
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
  _ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from typing import Any, Sequence  # noqa: E402

import jax  # noqa: E402
from jax.experimental import topologies  # noqa: E402

from disa_jax.data.packing import PackingLayout  # noqa: E402
from disa_jax.parallel import hlo_facts  # noqa: E402
from disa_jax.workflows import stage3_programs  # noqa: E402

from plan_memory import make_programs  # noqa: E402  (this directory)

# Per chip (Google Cloud TPU system architecture pages): HBM bytes, HBM bytes/s, bf16 FLOP/s.
CHIPS = {"v5e": (16 * 2**30, 819e9, 197e12), "v5p": (95 * 2**30, 2765e9, 459e12),
         "v4": (32 * 2**30, 1200e9, 275e12), "v6e": (32 * 2**30, 1640e9, 918e12)}


def chip_of(slice_name: str) -> str:
  chip = slice_name.split(":")[0]
  if chip not in CHIPS or ":" not in slice_name:
    raise ValueError(f"slice {slice_name!r}: expected <chip>:<shape> with chip one of "
                     f"{sorted(CHIPS)}, e.g. v5e:2x2 or v5p:2x2x1")
  return chip


def compile_program(name: str, lowered: Any, hbm: int) -> dict[str, Any]:
  t0 = time.perf_counter()
  compiled = lowered.compile()
  seconds = time.perf_counter() - t0
  m = compiled.memory_analysis()
  facts = hlo_facts.read_module(compiled.as_text())
  total = (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
           + m.temp_size_in_bytes)
  return dict(program=name, compile_s=round(seconds, 1), argument_bytes=m.argument_size_in_bytes,
              output_bytes=m.output_size_in_bytes, alias_bytes=m.alias_size_in_bytes,
              temp_bytes=m.temp_size_in_bytes, total_bytes=total, fits=total <= hbm,
              custom_calls=facts.custom_calls, collectives=facts.collectives,
              dot_flops=facts.dot_flops, largest=[b.shape for b in facts.largest[:4]],
              data_dependent_loops=[w.name for w in facts.data_dependent_loops])


def plan_slice(slice_name: str, args: argparse.Namespace) -> dict[str, Any]:
  """The Stage 3 programs of ``args.model`` on every chip of ``slice_name``, compiled."""
  hbm, bandwidth, peak = CHIPS[chip_of(slice_name)]
  topo = topologies.get_topology_desc(topology_name=slice_name, platform="tpu")
  devices = list(topo.devices)
  p = make_programs(args.model, fsdp=len(devices), devices=devices, num_layers=args.layers,
                    attention_impl=args.attention_impl)
  rows = args.rows_per_chip * len(devices)
  layout = PackingLayout(row_len=args.row_len, rows=rows,
                         seqs_per_row=p.train.rollout.seqs_per_row)
  mb = stage3_programs.abstract_micro_batch(layout, p.train.rollout.max_response_len, p.mesh)
  lowered = p.step.lower(p.state, mb)
  programs = {"micro": lowered["micro"], "optim": lowered["finish"],
              "score": p.score.lower(p.state.params, mb.rows)}
  out = dict(slice=slice_name, chips=len(devices), device_kind=devices[0].device_kind,
             hbm_bytes=hbm, hbm_bytes_per_s=bandwidth, bf16_flops_per_s=peak, model=args.model,
             layers=p.config.num_layers, rows=rows, row_len=args.row_len,
             attention_impl=p.attention_impl, remat_policy=p.remat_policy,
             adam_bytes=stage3_programs.device_bytes(p.state.opt_state), ref_bytes=p.ref_bytes,
             programs=[])
  for name, low in programs.items():
    rec = compile_program(name, low, hbm)
    resident = out["adam_bytes"] * (name != "optim") + out["ref_bytes"]
    rec.update(with_resident_bytes=rec["total_bytes"] + resident,
               fits_with_resident=rec["total_bytes"] + resident <= hbm)
    print(f"{slice_name} {name}: compile {rec['compile_s']} s, per chip "
          f"{rec['total_bytes'] / 2**30:.2f} GiB (+ AdamW/ref {resident / 2**30:.2f}) of "
          f"{hbm / 2**30:.0f} GiB; custom calls {rec['custom_calls']}; collectives "
          f"{ {k: v['count'] for k, v in rec['collectives'].items()} }", flush=True)
    out["programs"].append(rec)
  return out


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--slices", default="v5e:2x2,v5p:2x2x1", help="comma-separated")
  ap.add_argument("--model", default="qwen3-4b-base")
  ap.add_argument("--layers", type=int, default=None, help="default: the preset's")
  ap.add_argument("--row-len", type=int, default=16384)
  ap.add_argument("--rows-per-chip", type=int, default=1)
  ap.add_argument("--attention-impl", default="auto", help="'auto' = splash on a TPU")
  ap.add_argument("--json", default=None)
  args = ap.parse_args(argv)
  args.slices = [s for s in args.slices.split(",") if s]
  for s in args.slices:
    chip_of(s)
  return args


def main(argv: Sequence[str] | None = None) -> None:
  args = parse_args(argv)
  t0 = time.perf_counter()
  records = []
  for s in args.slices:
    try:
      records.append(plan_slice(s, args))
    except Exception as e:  # pylint: disable=broad-except  (recorded: the table says why)
      records.append(dict(slice=s, error=f"{type(e).__name__}: {str(e)[:800]}"))
      print(f"{s}: does not compile: {records[-1]['error']}", flush=True)
  out = dict(command="python benchmarks/tpu_compile_stage3.py " + " ".join(
      sys.argv[1:] if argv is None else argv), jax=jax.__version__,
             seconds=round(time.perf_counter() - t0, 1), slices=records)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(out, f, indent=1)
  print(f"total {out['seconds']:.0f} s")


if __name__ == "__main__":
  main()
