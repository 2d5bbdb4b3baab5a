"""`pipeline.readings`: the on-policy block's declared readings from its Holm-corrected tests."""
import pytest

from configs import main as main_config
from disa_jax import codec
from disa_jax.pipeline import readings as RD
from disa_jax.pipeline.endpoints import EndpointsConfig
from disa_jax.pipeline.job_config import MainConfig
from disa_jax.pipeline.report_records import EndpointTest


def _tests(arm: str, exact_vargrad, exact_centred, centred_vargrad, *, endpoint="kl_auc"):
  """The three declared tests of an arm from (diff, Holm p) pairs (None: not run), plus the same
  pairs on the held-out prompts with the opposite outcome (which the readings must not read)."""
  out = []
  for (a, b), got in zip(RD.PAIRS, (exact_vargrad, exact_centred, centred_vargrad)):
    diff, q = got if got is not None else (None, None)
    for ps, sign in (("train", 1), ("heldout", -1)):
      out.append(EndpointTest(a=f"{a}_{arm}", b=f"{b}_{arm}", endpoint=endpoint, set=ps,
                              p=q, p_holm=q, diff=None if diff is None else sign * diff,
                              n_a=5, n_b=5))
  return out


def test_each_declared_pattern_gets_its_reading():
  baseline = _tests("c1", (0.2, 0.001), (0.15, 0.01), (0.05, 0.4))
  more = _tests("c1", (0.2, 0.001), (0.01, 0.9), (0.19, 0.002))
  all_three = _tests("c1", (0.3, 0.001), (0.1, 0.01), (0.2, 0.002))  # centring explains a part
  opposite = _tests("c1", (0.2, 0.001), (-0.15, 0.01), (0.05, 0.4))  # centring goes the other way
  nothing = _tests("c1", (0.2, 0.06), (0.15, 0.01), (0.05, 0.4))  # the first test not shown
  untested = _tests("c1", None, None, None)
  assert RD.arm_reading("c1", baseline, 0.05).reading == RD.BASELINE
  assert RD.arm_reading("c1", more, 0.05).reading == RD.MORE
  assert RD.arm_reading("c1", all_three, 0.05).reading == RD.MORE
  for tests in (opposite, nothing, untested):
    assert RD.arm_reading("c1", tests, 0.05).reading == RD.OTHER
  signs = [t.sign for t in RD.arm_reading("c1", baseline, 0.05).tests]
  assert signs == [1, 1, 0]


def test_surviving_without_clipping_needs_the_same_sign_shown_in_every_arm():
  c1 = _tests("c1", (0.2, 0.001), (0.15, 0.01), (0.05, 0.4))
  same = _tests("c0", (0.1, 0.02), (0.1, 0.2), (0.0, 1.0))
  flipped = _tests("c0", (-0.1, 0.02), (0.1, 0.2), (0.0, 1.0))
  unshown = _tests("c0", (0.1, 0.2), (0.1, 0.2), (0.0, 1.0))
  assert RD.read(c1 + same, ("c1", "c0"), 0.05).survives_without_clipping
  assert not RD.read(c1 + flipped, ("c1", "c0"), 0.05).survives_without_clipping
  assert not RD.read(c1 + unshown, ("c1", "c0"), 0.05).survives_without_clipping
  assert not RD.read(c1, ("c1",), 0.05).survives_without_clipping  # one arm: nothing to compare
  r = RD.read(c1 + same, ("c1", "c0"), 0.05)
  assert codec.decode(RD.Readings, codec.encode(r), "report.json") == r  # report.json round trip
  md = "\n".join(RD.markdown(r))
  assert "| c1 | +0.200, Holm p 0.001: A higher | +0.150, Holm p 0.01: A higher | +0.050, Holm p " \
         "0.4: not shown | a baseline (variance) effect |" in md
  assert "Survives without clipping: yes" in md and RD.markdown(None) == []


def test_a_missing_declared_test_is_named():
  tests = _tests("c1", (0.2, 0.001), (0.15, 0.01), (0.05, 0.4), endpoint="kl_end")
  with pytest.raises(ValueError, match="disa_exact_c1 - vargrad_c1 on the train prompts' kl_auc"):
    RD.read(tests, ("c1",), 0.05)


def test_the_on_policy_preset_declares_both_arms_and_the_config_checks_their_tests():
  cfg = MainConfig.from_config(main_config.get_config("coupling_onpolicy"))
  assert cfg.endpoints.reading_arms(cfg.methods) == ("c1", "c0")
  quick = MainConfig.from_config(main_config.get_config("coupling_onpolicy_quick"))
  assert quick.endpoints.reading_arms(quick.methods) == ("c1", "c0")
  short = EndpointsConfig(compare=("disa_exact_c1:vargrad_c1",), readings=("c1",))
  with pytest.raises(ValueError, match="endpoints.readings arm 'c1' needs .*missing "
                                       r"\['disa_exact_c1:disa_exact_centred_c1'"):
    short.reading_arms(("disa_exact_c1", "disa_exact_centred_c1", "vargrad_c1"))
