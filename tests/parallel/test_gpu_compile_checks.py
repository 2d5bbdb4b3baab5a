"""XLA:GPU programs checked without a GPU (`parallel.gpu_compile`, issue 66).

The compile-only checks (marked ``gpu_aot``: JAX's CUDA plugin in ``.gpu_aot/``, which
`launch/install.sh` installs): the Stage 3 micro step of small real shapes compiled for an H100 by
`gpu_compile_cases.py` in one subprocess (about 2 minutes on 2 busy cores: three compiles of 40 s)
passes `GpuPlan.checks`, and each check fires on the defect it guards: one cuDNN segment slot per
token (the max_segments bug: a T^2 statistics buffer and 16,384 slots for 16 sequences), a card
too small for the plan. The rest needs no plugin: card descriptions, topologies, the T^2 rule.
"""
import json
import math
import pathlib
import subprocess
import sys

import pytest

from disa_jax.parallel import gpu_compile, hlo_facts
from launch import check_env

HERE = pathlib.Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
  out = tmp_path_factory.mktemp("gpu_compile") / "cases.json"
  env = gpu_compile.compile_env()
  env.pop("JAX_COMPILATION_CACHE_DIR", None)  # compile for real, every time
  run = subprocess.run([sys.executable, str(HERE / "gpu_compile_cases.py"), str(out)], env=env,
                       capture_output=True, text=True, timeout=900)
  assert run.returncode == 0, run.stderr[-3000:]
  return json.loads(out.read_text())


@pytest.mark.gpu_aot
@pytest.mark.slow
def test_small_real_shapes_pass_their_checks(cases):
  """qwen3-0.6b at 4k-token rows and two layers of Qwen3-4B at 16k, cuDNN attention ('auto' on a
  GPU), the paper config's full remat: no T^2 buffer, one cuDNN segment slot per packed sequence
  (rollout.seqs_per_row), within the H100's memory, compiled FLOPs <= 1.4x the useful ones."""
  for name in ("qwen3-0.6b 4k", "qwen3-4b-base 2 layers 16k"):
    c = cases[name]
    assert c["checks"] == [] and c["impl"] == "cudnn", (name, c)
    assert c["slots"] == [c["seqs_per_row"]] == [16]
    assert c["peak"] < c["capacity"] and c["flops_ratio"] <= 1.4


@pytest.mark.gpu_aot
@pytest.mark.slow
def test_one_slot_per_token_fails_the_square_and_slot_checks(cases):
  checks = cases["qwen3-4b-base 2 layers 16k, one slot per token"]["checks"]
  assert any("has >= T^2 = 16384^2 elements" in c for c in checks), checks
  assert any("cuDNN segment slots [16384], the packing has 16" in c for c in checks), checks


@pytest.mark.gpu_aot
@pytest.mark.slow
def test_a_plan_over_the_cards_memory_fails(cases):
  checks = cases["qwen3-0.6b 4k, card 1 byte short"]["checks"]
  assert len(checks) == 1 and "over the card's" in checks[0]


def test_cards_and_topologies():
  h100, h200, a100 = (gpu_compile.load_card(n) for n in ("h100_sxm", "h200", "a100_sxm_80"))
  assert (h100.memory_bytes, h200.memory_bytes) == (84942979072, 151397597184)
  assert (h100.compute_capability, a100.compute_capability) == ((9, 0), (8, 0))
  assert a100.hbm_bytes_per_s < h100.hbm_bytes_per_s < h200.hbm_bytes_per_s
  assert gpu_compile.parse_topology("1x2x8") == (1, 2, 8)
  with pytest.raises(ValueError, match="card='v100': expected one of"):
    gpu_compile.load_card("v100")
  with pytest.raises(ValueError, match="topology='2x8': expected partitions x hosts x devices"):
    gpu_compile.parse_topology("2x8")


def _report(*shapes):
  dims = gpu_compile._dims  # pylint: disable=protected-access
  buffers = tuple(hlo_facts.Buffer(s, 0, math.prod(dims(s)), "op", "") for s in shapes)
  facts = hlo_facts.ModuleFacts(0, buffers, {}, {}, {}, (), ())
  return gpu_compile.ProgramReport("micro", "h100_sxm", "1x1x1", 0.0, 0, 0, 0, 0, 1, 0.0, 0, facts)


def test_the_square_rule_skips_model_widths():
  """[T x M, N, T] cuDNN statistics are quadratic, [T, vocab] logits are not; at T = 4096,
  Qwen3-0.6B's fused q, k, v width, a [T, 4096] activation is not either (so a buffer whose T
  dimensions all equal a width is not seen: the CI's T^2 check runs at 16k, no width of the 4B)."""
  big = _report("f32[16384,32,16384]", "f32[16384,151936]", "bf16[16384,6144]")
  widths = (6144, 151936)
  assert [b.shape for b in gpu_compile.square_buffers(big, 16384, widths)] == [
      "f32[16384,32,16384]"]
  small = _report("bf16[4096,4096]")
  assert gpu_compile.square_buffers(small, 4096, widths=(4096,)) == []
  assert len(gpu_compile.square_buffers(small, 4096)) == 1  # without the widths: a false alarm


def test_the_plugin_check_names_what_is_missing(tmp_path):
  found = check_env.gpu_aot_problems(str(tmp_path))
  assert len(found) == 2 and found[0].startswith("jax-cuda13-plugin==")
  assert "launch/install.sh" in found[0]
  assert not gpu_compile.plugin_installed(tmp_path)
