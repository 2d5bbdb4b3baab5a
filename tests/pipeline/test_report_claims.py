"""`pipeline.claims`'s verdicts on made-up runs: every comparison uses the primary KL, failures are
counted by Fisher's test and left out of Welch's, the family is Holm-corrected, untested claims are
undecided, the oracle claim is an equivalence test, matched accuracy is interpolated, and each
claim carries the end state of the methods it compares."""
import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest

from configs import main as main_config
from disa_jax import codec
from disa_jax.anchor.diagnostics import Prop4Check
from disa_jax.pipeline.dynamics import Matched
from disa_jax.pipeline.report_records import Stage1Section, Stage2Section
from disa_jax.pipeline import claims as C
from disa_jax.pipeline import report as R
from disa_jax.pipeline import report_md as MD
from disa_jax.pipeline import seed_stats
from disa_jax.pipeline.job_config import MainConfig
from disa_jax.pipeline.plan import job_plan
from disa_jax.pipeline.stage12 import stage2_section

TARGET_H = 1.84


def _row(kl, se=0.01, entropy=1.7):
  return {"kl_decomposed": kl, "kl_decomposed_se": se, "kl_to_target": kl + 0.05,
          "entropy_correct": entropy, "target_entropy_correct": TARGET_H}


def _state(reason):
  """A method's pooled end state (`dynamics.EndState`) with ``reason``."""
  return R.D.EndState(reached=reason == "flat", reason=reason, points=10, min_points=10, kl=None,
                      kl_correct=None, window_steps=(600, 800), lr_decay_step=None, step=800,
                      last={})


def _ev(values, states=None, matched=None, reference_kl=6.0, entropy=None):
  """Evidence of methods -> per-seed KL (and entropies: method -> list)."""
  rows = {m: [(s, _row(v, entropy=(entropy or {}).get(m, [1.7] * len(vs))[s]))
              for s, v in enumerate(vs)] for m, vs in values.items()}
  states = states or {m: "flat" for m in values}
  return C.Evidence(seed_rows=rows, reference_kl=reference_kl,
                    method_states={m: _state(r) for m, r in states.items()},
                    matched_runs=matched or {})


def _one(claims, start):
  got = [c for c in claims if c.claim.startswith(start)]
  assert len(got) == 1, [c.claim for c in claims]
  return got[0]


def test_the_state_comes_from_the_compared_methods_pooled_end_states():
  ev = _ev({"fix": [0.1, 0.2], "grpo": [0.3, 0.4], "disa": [0.2, 0.3]},
           states={"fix": "flat", "grpo": "moving", "disa": "unresolved"})
  assert ev.state(("fix", "grpo")) == ("transient", True)
  assert ev.state(("fix", "disa")) == ("undecided", True)
  assert ev.state(("fix",)) == ("end state", False) and ev.state(()) == ("-", False)
  assert ev.state(("never_measured",)) == ("undecided", True)


def test_three_documented_seeds_do_not_decide_and_five_clear_seeds_do():
  ev = _ev({"fix": [0.155, 0.171, 0.187], "grpo": [0.176, 0.340, 0.504]})
  c = _one(C.finalise(C.kl_pair(ev, "fix", "grpo")), "fix's KL")
  assert c.verdict == "does not hold" and not c.holds
  assert c.test.p == pytest.approx(0.217, abs=0.01) and "Holm-adjusted" in c.why
  ev = _ev({"fix": [0.15, 0.17, 0.16, 0.18, 0.17], "grpo": [0.5, 0.6, 0.55, 0.7, 0.4]})
  c = _one(C.finalise(C.kl_pair(ev, "fix", "grpo")), "fix's KL")
  assert c.holds and c.verdict == "holds" and c.test.p_holm < 0.01
  assert c.numbers["metric"] == "kl_decomposed" and c.state == "end state"


def test_one_seed_is_undecided_never_does_not_hold():
  c = _one(C.finalise(C.kl_pair(_ev({"fix": [0.1], "grpo": [0.9]}), "fix", "grpo")), "fix's KL")
  assert c.verdict == "undecided" and not c.holds and c.test is None
  assert "fewer than 2 seeds" in c.why and c.numbers["seeds"] == [1, 1]


def test_collapsed_runs_are_counted_by_fisher_and_left_out_of_welch():
  h = {"fix": [1.7] * 3, "grpo": [0.05, 0.02, 0.08]}
  ev = _ev({"fix": [0.2, 0.25, 0.22], "grpo": [1.8, 1.6, 1.7]}, entropy=h)
  out = C.finalise(C.kl_pair(ev, "fix", "grpo"))
  fisher, welch = _one(out, "fix fails"), _one(out, "fix's KL")
  assert fisher.test is None and fisher.verdict == "undecided"  # 3 a side: p >= 0.1 always
  assert fisher.numbers["min_p"] == pytest.approx(0.1) and "smallest p they allow is 0.1" in fisher.why
  assert fisher.numbers["failed"]["grpo"] == {"0": "collapsed", "1": "collapsed", "2": "collapsed"}
  assert welch.verdict == "undecided" and "0 of 3 of grpo" in welch.why
  h5 = {"fix": [1.7] * 5, "grpo": [0.05] * 5}
  ev = _ev({"fix": [0.2, 0.25, 0.22, 0.21, 0.2], "grpo": [1.8, 1.6, 1.7, 1.7, 1.9]}, entropy=h5)
  fisher = _one(C.finalise(C.kl_pair(ev, "fix", "grpo")), "fix fails")
  assert fisher.holds and fisher.test.p == pytest.approx(2 / 252)  # 0/5 against 5/5


def test_a_diverged_run_is_left_out_and_the_count_says_so():
  ev = _ev({"a": [0.2, 0.21, 0.19, 90.0], "b": [0.5, 0.55, 0.45]}, reference_kl=6.0)
  out = C.finalise(C.kl_pair(ev, "a", "b"))
  welch = _one(out, "a's KL")
  assert welch.numbers["failed"]["a"] == {"3": "diverged"} and welch.numbers["seeds"] == [3, 3]
  assert welch.holds and "(1 of a, 0 of b left out: failed)" in welch.test.summary
  assert _one(out, "a fails").verdict == "undecided"  # 1 of 7 failed: no split reaches 0.05
  near = _ev({"a": [11.0, 11.9], "b": [11.5, 11.2]}, reference_kl=11.3)  # barely trained: not failed
  assert near.split("a") == ([(0, near.seed_rows["a"][0][1]), (1, near.seed_rows["a"][1][1])], {})
  assert _ev({"a": [float("nan")]}, reference_kl=None).split("a")[1] == {0: "diverged"}


def test_holm_over_the_family_can_overturn_a_lone_p_below_005():
  vals = {"a": [0.30, 0.32, 0.31], "b": [0.34, 0.35, 0.33]}
  alone = C.finalise(C.kl_pair(_ev(vals), "a", "b"))[0]
  p = alone.test.p
  assert alone.holds and 0.01 < p < 0.05  # holds alone ...
  vals |= {f"n{i}": [0.30 + 0.001 * i, 0.32 - 0.001 * i, 0.31] for i in range(4)}  # no difference
  ev = _ev(vals)
  out = C.finalise(C.kl_pair(ev, "a", "b") + [x for i in range(4) for x in C.kl_pair(ev, f"n{i}", "a")])
  first = out[0]
  assert first.test.p == p and first.test.p_holm == pytest.approx(5 * p)
  assert not first.holds and first.verdict == "does not hold"  # ... not in a family of 5
  assert f"p = {p:.3g}, Holm-adjusted over the report's 5 tests {5 * p:.3g}" in first.why


def test_a_two_sided_pair_holds_either_way_and_says_which_is_lower():
  ev = _ev({"a": [0.5, 0.52, 0.51, 0.5], "b": [0.2, 0.21, 0.19, 0.2]})
  c = _one(C.finalise(C.kl_pair(ev, "a", "b", two_sided=True)), "a's and b's KL")
  assert c.holds and c.numbers["diff"] > 0
  one = _one(C.finalise(C.kl_pair(ev, "a", "b")), "a's KL")  # 'a<b' declared: the wrong sign
  assert not one.holds and "other sign" in one.why
  assert C.parse_comparison("x<>y") == ("x", "y", True) and C.parse_comparison("x<y") == ("x", "y", False)
  for bad in ("x<x", "x>y", "x", "x<<y"):
    with pytest.raises(ValueError, match="must be 'A<B' or 'A<>B'"):
      C.parse_comparison(bad)


def test_as_close_as_the_oracle_is_an_equivalence_test_that_can_fail():
  ev = _ev({"fix": [0.300, 0.302, 0.298, 0.301, 0.299], "disa_exact": [0.301, 0.299, 0.300, 0.302, 0.298]})
  c = C.finalise([C.as_close_as_oracle(ev, "fix", "disa_exact")])[0]
  assert c.holds and c.numbers["margin"] == pytest.approx(0.09) and c.test.name == "tost"
  far = _ev({"fix": [0.45, 0.5, 0.4, 0.48, 0.42], "disa_exact": [0.3, 0.31, 0.29, 0.3, 0.3]})
  c = C.finalise([C.as_close_as_oracle(far, "fix", "disa_exact")])[0]
  assert not c.holds and c.verdict == "does not hold"  # KL 0.45 is not "the target's"
  noisy = _ev({"fix": [0.2, 0.4, 0.3], "disa_exact": [0.25, 0.35, 0.3]})  # too few, too noisy
  assert not C.finalise([C.as_close_as_oracle(noisy, "fix", "disa_exact")])[0].holds


def _matched(p, entropy, past=False):
  lvl = Matched(step=500.0, p_correct=0.9, entropy_correct=entropy, kl_correct=0.1, kl=0.3,
                kl_mc=0.3, already_past=past)
  return {"0.5": dataclasses.replace(lvl, already_past=True),
          "0.7": dataclasses.replace(lvl, already_past=True), "0.9": lvl if p >= 0.9 else None}


def test_matched_accuracy_uses_the_interpolated_seeds_and_leaves_out_those_already_past():
  matched = {"fix": [(0, _matched(0.93, 1.75)), (1, _matched(0.95, 1.7)), (2, _matched(0.85, 1.8))],
             "grpo": [(0, _matched(0.97, 0.1)), (1, _matched(0.91, 0.2)), (2, _matched(0.96, 0.15, past=True))]}
  ev = _ev({"fix": [0.2] * 3, "grpo": [1.8] * 3}, matched=matched, states={"fix": "flat", "grpo": "moving"})
  c = C.finalise([C.matched_entropy(ev, "fix", "grpo")])[0]
  n = c.numbers
  assert c.claim.startswith("reward maximisation collapses: at P(correct) = 0.9 (interpolated)")
  assert n["fix_seeds"] == [0, 1] and n["grpo_seeds"] == [0, 1] and n["grpo_already_past"] == [2]
  assert c.holds and c.state == "transient" and c.from_transient
  only_past = {m: [(s, _matched(0.5, 1.0)) for s in range(3)] for m in ("fix", "grpo")}
  c = C.finalise([C.matched_entropy(_ev({"fix": [0.2] * 3, "grpo": [1.8] * 3}, matched=only_past),
                                    "fix", "grpo")])[0]
  assert c.verdict == "undecided" and "already past it at the first: 3 / 3" in c.why


def test_the_stage1_claim_uses_disjoint_draws_per_n():
  p_, pool = 6, 32
  log_w = np.zeros((p_, pool))
  log_w[:, :2] = np.log([0.2, 0.4])  # N = 2: samples 0-1; N = 4: 2-5; N = 8: 6-13; N = 16: 14-29
  log_w[:, 30:] = 50.0  # beyond the blocks: never read
  mask = np.ones((p_, pool), bool)
  mask[0, 14:30] = False  # prompt 0 has no valid sample at N = 16
  errs = C.stage1_disjoint_errors(log_w, mask, np.zeros(p_), (2, 4, 8, 16))
  assert list(errs) == ["2", "4", "8", "16"]
  assert errs["2"] == pytest.approx([-np.log(0.3)] * p_) and errs["16"][1:] == [0.0] * 5
  assert np.isnan(errs["16"][0]) and errs["4"] == [0.0] * p_
  assert C.stage1_disjoint_errors(log_w, mask, np.zeros(p_), (16, 32)) == {}  # only 16 fits
  noisy = {"2": [0.5, 0.6, 0.4, 0.55, 0.45], "16": [0.1, 0.2, 0.15, 0.12, 0.1]}
  c = C.finalise([C.stage1_claim(_ev({}), noisy)])[0]
  assert c.holds and c.runs == () and c.numbers["prompts"] == 5


def test_build_claims_makes_each_claim_once_and_corrects_them_together():
  ev = _ev({"fix": [0.2, 0.22, 0.21], "disa": [0.3, 0.31, 0.29], "disa_exact": [0.2, 0.21, 0.2],
            "grpo": [1.8, 1.7, 1.9], "ctl": [0.5, 0.55, 0.45]},
           entropy={"grpo": [0.05] * 3})
  plan = C.Plan(fix="fix", disa="disa", oracle="disa_exact", contrasts=("grpo",),
                controls=("ctl", "grpo"), compare=("disa<>ctl",),
                replay=())  # grpo: a reward maximiser and a control, tested once
  out = R.C.build_claims(ev, plan, None)
  texts = [c.claim.split(" (")[0] for c in out]
  assert len(texts) == len(set(texts))
  tested = [c for c in out if c.test is not None]
  adj = seed_stats.holm([c.test.p for c in tested])
  assert [c.test.p_holm for c in tested] == pytest.approx(adj.tolist())
  assert {c.verdict for c in out} <= {"holds", "does not hold", "undecided"}
  assert _one(out, "fix's KL to the target is below grpo's").verdict == "undecided"
  assert len([c for c in out if set(c.runs) == {"fix", "grpo"}]) == 2  # Fisher + Welch, once
  with pytest.raises(ValueError, match="needs the reason"):
    C.claim(ev, "x", {}, ())


def test_prop4_is_numbers_never_a_verdict_that_cannot_fail():
  """Issue 62, item 8: the envelope 'held' at a gap of 0.15 against 3.19 (anchor_testbed_rl); it
  is Cauchy-Schwarz on the same moments, so no verdict, and the gap's share of the envelope."""
  check = Prop4Check(sigma_g_train=0.5, sigma_g_heldout=0.6, loss_tb=11.72, loss_disa=11.87,
                     loss_gap=0.15, envelope_same_sample=2.0, envelope=3.19, verdict="holds")
  out = R.prop4_numbers(check)
  assert out.check.verdict is None and "cannot fail" in out.verdict_why
  assert out.gap_over_envelope == pytest.approx(0.15 / 3.19)
  assert np.isnan(R.prop4_numbers(dataclasses.replace(check, envelope=float("nan"), verdict=None))
                  .gap_over_envelope)
  md = "\n".join(MD.anchor_gap_md({"kl_disa": 0.3, "kl_disa_exact": 0.2, "kl_gap": 0.1}
                                   | codec.encode(out)))
  assert "(the gap is 0.047 of it): no verdict: a check that cannot fail" in md
  old = {"loss_tb": 3.04, "envelope": 4.06, "loss_gap": 0.26, "verdict": None,
         "verdict_why": "the envelope 4.0600 is not below L_TB = 3.0400"}  # a committed report's
  old_md = "\n".join(MD.anchor_gap_md({"kl_disa": 0.3, "kl_disa_exact": 0.2, "kl_gap": 0.1,
                                        "sigma_g_train": 0.5, "loss_disa": 3.3,
                                        "envelope_same_sample": 2.0, "sigma_g_heldout": 0.6} | old))
  assert "4.0600: no verdict (the envelope 4.0600 is not below L_TB" in old_md
  ins = R.instrument(R.D.EndStateConfig())
  assert ins.primary_metric == "kl_decomposed" and ins.correction == "holm"
  assert ins.endpoint_tests["steps_to_p90"].startswith("gehan") and ins.end_state["serial"]


def _plan(methods, label_scale="sum", compare=()):
  """The plan of a job training ``methods`` (on-policy DISA runs of those names) on 3 seeds."""
  c = main_config.get_config()
  for m in methods:
    c.runs[m] = main_config._run(main_config._tb("disa"))  # pylint: disable=protected-access
  c.methods, c.seeds, c.fix, c.compare = tuple(methods), (0, 1, 2), "", compare
  c.anchor_replicas = 1  # (the default job's anchor replicas: not this helper's runs)
  c.stage1.label_scale = label_scale
  return job_plan(MainConfig.from_config(c), "/tmp/unused")


def test_the_report_reads_the_runs_and_makes_the_stage1_claim_only_on_the_labels_scale():
  plan = _plan(("k0", "k2"), compare=("k0<k2",))
  runs = {plan.runs[m].row(s): _row(v)
          for m, vs in (("k0", [0.2, 0.21, 0.19]), ("k2", [0.5, 0.6, 0.58]))
          for s, v in enumerate(vs)} | {"reference": _row(0.25)}  # k2's seeds 1, 2: diverged
  dyn = R.Dynamics(series={}, ends={}, states={}, matched_runs={})
  s1 = Stage1Section(n=4, pool=4, label_scale="sum", ess_median=2.0, cv2_median=0.5,
                     proposal_accuracy=0.8, prompts_without_correct_sample=0, grade_errors=0,
                     n_study_variance={}, log_z_exact_mean=1.0, log_z_exact_std=0.1,
                     n_disjoint_abs_error={"2": [0.5, 0.6, 0.4], "16": [0.1, 0.2, 0.15]})
  out = R._claims(plan, s1, runs, dyn, None, [])
  assert out[0].claim.startswith("the Stage 1 error shrinks with N")
  welch = _one(out, "k0's KL")
  assert welch.numbers["failed"]["k2"] == {"1": "diverged", "2": "diverged"}
  assert welch.verdict == "undecided"  # one k2 run left: no test
  mean = _plan(("k0", "k2"), "mean", ("k0<k2",))  # (labels of the length-normalised residual)
  out = R._claims(mean, s1, runs, dyn, None, [])
  assert not any(c.claim.startswith("the Stage 1") for c in out)


def test_on_the_mean_scale_the_stage12_sections_print_no_error_against_the_exact_log_z():
  plan = _plan(("disa",), label_scale="mean")
  anchor = SimpleNamespace(embeddings=lambda: (("a", "b"), np.zeros((2, 4))), val_prompt_ids=("b",),
                           fit=SimpleNamespace(best_epoch=3, val_mse=0.2, val_r2=0.5),
                           history={"val_mse": [0.3, 0.2]})
  exact = SimpleNamespace(log_z_of=lambda ids: pytest.fail("the exact log Z read on the mean scale"))
  s2 = stage2_section(plan, anchor, None, exact)
  assert s2 == Stage2Section(best_epoch=3, val_mse_vs_labels=0.2, val_r2_vs_labels=0.5, n_val=1,
                             val_mse_curve=(0.3, 0.2))
  assert codec.encode(s2) == {"best_epoch": 3, "val_mse_vs_labels": 0.2, "val_r2_vs_labels": 0.5,
                              "n_val": 1}  # (the curve is plotted, not stored)
  s1 = {"n": 4, "label_scale": "mean", "ess_median": 2.0, "cv2_median": 0.5,
        "proposal_accuracy": 0.8, "prompts_without_correct_sample": 0,
        "n_study_variance": {"2": 0.3, "4": 0.1}}
  md = "\n".join(MD.stage12_md(s1, codec.encode(s2), None))
  assert "no exact value to compare with" in md and "| 4 | 0.1000 |" in md
  assert "log Z_IS - log Z" not in md and "sigma_g" not in md
