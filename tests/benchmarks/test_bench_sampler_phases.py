"""benchmarks/bench_sampler_phases.py: the per-decode-step figure is the difference of the two
lengths' medians over the decode steps, ratios are to the first variant, and a variant's layout and
decode attention reach the sampler it times."""
import json

import pytest

from tests.benchmarks.scripts import load

bs = load("bench_sampler_phases")


def _times(one, full):
  return {1: {"wall": one, "cpu": one}, 8: {"wall": full, "cpu": full}}


def test_per_step_time_is_the_medians_difference_over_the_decode_steps_and_ratios_to_the_first():
  times = {"dense": _times([0.004, 0.005, 0.009], [0.011, 0.012, 0.030]),
           "ragged": _times([0.006, 0.005, 0.007], [0.020, 0.026, 0.019])}
  out = bs.summarise(times, 8)
  dense, ragged = out["dense"]["cpu"], out["ragged"]["cpu"]
  assert dense["prefill_s"] == {"median": 0.005, "min": 0.004, "max": 0.009}
  assert dense["per_decode_step_s"] == pytest.approx((0.012 - 0.005) / 7)
  assert ragged["per_decode_step_s"] == pytest.approx((0.020 - 0.006) / 7)
  assert ragged["ratio_to_first"]["generate_s"] == pytest.approx(0.020 / 0.012)
  assert ragged["ratio_to_first"]["per_decode_step_s"] == pytest.approx(2.0)
  assert dense["ratio_to_first"] == {"prefill_s": 1.0, "generate_s": 1.0, "per_decode_step_s": 1.0}


def test_variants_name_the_layout_and_the_decode_attention():
  assert bs.parse_variant("ragged") == ("ragged", "auto")
  assert bs.parse_variant("ragged:xla_live") == ("ragged", "xla_live")
  samplers = bs.build_samplers(["dense", "ragged:xla"])
  assert samplers["dense"].cache_layout == "dense"
  assert samplers["ragged:xla"].cache_layout == "ragged"
  assert samplers["ragged:xla"].model.options.decode_attention == "xla"
  assert samplers["dense"].model.options.decode_attention == "auto"


@pytest.mark.slow
def test_a_short_run_times_every_variant_at_both_lengths(tmp_path):
  out = tmp_path / "r.json"
  bs.main(["--variants", "dense,ragged", "--blocks", "1", "--reps", "2", "--warmup", "1",
           "--new-tokens", "3", "--json-out", str(out)])
  got = json.loads(out.read_text())
  assert got["variants"] == ["dense", "ragged"] and len(got["loads"]) == 1
  for name in ("dense", "ragged"):
    assert len(got["times"][name]["3"]["wall"]) == 2 and len(got["times"][name]["1"]["cpu"]) == 2
    assert got["summary"][name]["cpu"]["n"] == 2
  with pytest.raises(SystemExit, match="--new-tokens"):
    bs.main(["--new-tokens", "1"])
