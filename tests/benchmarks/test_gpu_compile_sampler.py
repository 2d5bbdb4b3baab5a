"""The arithmetic of benchmarks/gpu_compile_sampler.py and tpu_compile_stage3.py that needs no
compiler: the slots that fit a card, a decode step's lower bound, the decode attentions that pass,
and the TPU slice names (the compiles themselves: tests/rollout/test_sampler_gpu_compile.py)."""
import pytest

from disa_jax import models
from disa_jax.parallel import gpu_compile
from tests.benchmarks.scripts import load

gcs = load("gpu_compile_sampler")
tcs = load("tpu_compile_stage3")

CONFIG = models.get_preset("qwen3-4b-base")
H200 = gpu_compile.load_card("h200")


def test_the_slots_that_fit_an_h200():
  """256 rows of 256 + 1k fit (8.0 GB weights + 45 GiB cache); of 256 + 8k the cache alone is
  297 GiB, and 64 slots (74 GiB) are the most that fit 90% of 141 GiB."""
  assert gcs.fit_slots(CONFIG, gcs.Request(256, 8, 256, 1024, 256), H200) == 256
  assert gcs.fit_slots(CONFIG, gcs.Request(256, 8, 256, 8192, 256), H200) == 64


def test_a_decode_steps_lower_bound():
  """'xla' reads the whole cache, 'pallas' the live part on average (prompt + half the new
  tokens); the bound is the larger of the bytes at bandwidth and the FLOPs at peak."""
  req = gcs.Request(256, 8, 256, 1024, 256)
  rec = {"dot_flops": 2e12}
  whole = gcs.decode_floor(rec, card=H200, impl="xla", req=req, weight_bytes=8, cache_bytes=1280)
  live = gcs.decode_floor(rec, card=H200, impl="pallas", req=req, weight_bytes=8,
                          cache_bytes=1280)
  assert whole["floor_read_bytes"] == 8 + 1280 and live["floor_read_bytes"] == 8 + 768
  assert whole["floor_ms"] == pytest.approx(1e3 * 2e12 / H200.bf16_flops_per_s)  # compute-bound
  big = gcs.decode_floor(rec, card=H200, impl="xla", req=req, weight_bytes=8e9, cache_bytes=48e9)
  assert big["floor_ms"] == pytest.approx(1e3 * 56e9 / H200.hbm_bytes_per_s)
  assert big["floor_tokens_per_s"] == pytest.approx(256e3 / big["floor_ms"])


def test_only_fitting_loop_free_decode_attentions_pass():
  rec = lambda program, impl, fits=True, loops=(): dict(
      program=program, decode_attention=impl, fits=fits, data_dependent_loops=list(loops))
  records = [rec("prefill", "-"), rec("decode", "xla"), rec("decode", "pallas"),
             rec("decode", "xla_live", loops=["while.3"]), rec("decode", "pallas", fits=False)]
  assert gcs.passing(records, ["xla", "pallas", "xla_live"]) == ["xla"]
  assert gcs.passing([rec("prefill", "-", fits=False)] + records[1:2], ["xla"]) == []


def test_a_bad_tpu_slice_is_named():
  assert tcs.chip_of("v5p:2x2x1") == "v5p"
  with pytest.raises(ValueError, match="'v9x:2x2'"):
    tcs.chip_of("v9x:2x2")
  with pytest.raises(ValueError, match="'v5e'"):
    tcs.parse_args(["--slices", "v5e"])
