"""Stage 3 programs compiled for an H100 without a GPU, and the defects the checks guard.

Run by `test_gpu_compile_checks.py` in a subprocess (the CUDA plugin on PYTHONPATH, JAX on the CPU:
`gpu_compile.compile_env`): ``python tests/parallel/gpu_compile_cases.py OUT.json``. Each case
compiles the micro step (forward + backward of one packed row) with the trainer's own builder
(`benchmarks/plan_memory.make_programs`) and writes what `GpuPlan.checks` says about it.
"""
import dataclasses
import json
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import plan_memory  # noqa: E402  (benchmarks/: the paper config's settings, the one builder)
from disa_jax.parallel import gpu_compile  # noqa: E402
from disa_jax.workflows import stage3, stage3_programs  # noqa: E402

CARD = gpu_compile.load_card("h100_sxm")


def compile_plan(model: str, *, layers: int | None, row_len: int):
  devices = gpu_compile.topology_devices(CARD, "1x1x1")
  programs = plan_memory.make_programs(model, fsdp=1, devices=devices, attention_impl="auto",
                                       settings_of="qwen3-4b-base", num_layers=layers)
  return stage3_programs.compile_gpu_plan(programs, rows=1, row_len=row_len, seq_len=2048,
                                          card=CARD, topology="1x1x1", programs=("micro",))


def summary(g) -> dict:
  micro = g.programs["micro"]
  return dict(checks=g.checks(), impl=g.attention_impl, slots=list(micro.facts.cudnn_segment_slots),
              seqs_per_row=g.seqs_per_row, compile_s=micro.compile_s, peak=g.peak,
              capacity=micro.capacity_bytes, flops_ratio=g.flops_ratio)


def one_slot_per_token(row_len: int):
  """The defect of issue 66: a benchmark's own options without ``max_segments`` (then 0, which the
  cuDNN wrapper turned into one segment slot per token; now refused, so given as T here)."""
  real = stage3.model_options
  stage3.model_options = lambda mc, rc, *, trained: dataclasses.replace(
      real(mc, rc, trained=trained), max_segments=row_len)
  try:
    return compile_plan("qwen3-4b-base", layers=2, row_len=row_len)
  finally:
    stage3.model_options = real


def main(out: str) -> None:
  t0 = time.perf_counter()
  small = compile_plan("qwen3-0.6b", layers=None, row_len=4096)
  over = dataclasses.replace(small, programs={
      k: dataclasses.replace(r, capacity_bytes=small.peak - 1) for k, r in small.programs.items()})
  cases = {
      "qwen3-0.6b 4k": summary(small),
      "qwen3-0.6b 4k, card 1 byte short": summary(over),
      "qwen3-4b-base 2 layers 16k": summary(compile_plan("qwen3-4b-base", layers=2,
                                                         row_len=16384)),
      "qwen3-4b-base 2 layers 16k, one slot per token": summary(one_slot_per_token(16384)),
  }
  cases["seconds"] = time.perf_counter() - t0
  pathlib.Path(out).write_text(json.dumps(cases, indent=1))


if __name__ == "__main__":
  main(sys.argv[1])
