"""`pipeline.report`'s verdicts on made-up runs: every claim's TRANSIENT flag comes from the runs it
compares, comparisons need Welch's p < 0.05 over seeds, and the matched-accuracy claim reports the
P(correct) reached and which seeds got there."""
from types import SimpleNamespace

import numpy as np
import pytest

from disa_jax.pipeline import report as R

SEEDS = (0, 1, 2)


def _job(seeds=SEEDS):
  return SimpleNamespace(cfg=SimpleNamespace(seeds=seeds, run_seeds=lambda m: seeds,
                                             stage1=SimpleNamespace(label_scale="sum")),
                         run_name=lambda m, s: m if s == seeds[0] else f"{m}_seed{s}")


def _runs(values: dict[str, list[float]], se=0.01, seeds=SEEDS):
  job = _job(seeds)
  return {job.run_name(m, s): {"kl_to_target": v, "kl_to_target_se": se}
          for m, vs in values.items() for s, v in zip(seeds, vs)}


def _matched(p, entropy, step=1000):
  lvl = {"step": step, "p_correct": p, "entropy_correct": entropy, "kl_correct": 0.1, "kl": 1.0}
  return {"0.5": lvl, "0.7": lvl, "0.9": lvl if p >= 0.9 else None}


def _dyn(reached: dict[str, bool], matched: dict[str, list[tuple[int, dict]]]):
  dyn = {"end_state": {m: [{"reached": r, "reason": "flat" if r else "moving"}] for m, r in
                       reached.items()}, "matched_runs": matched, "matched": {}}
  for m, rows in matched.items():
    dyn["matched"][m] = {lvl: {"seeds_reached": [s for s, x in rows if x[lvl] is not None],
                               "seeds": len(rows)} for lvl in ("0.5", "0.7", "0.9")}
  return dyn


def test_a_claim_is_transient_when_any_run_it_compares_is():
  dyn = _dyn({"fix": True, "grpo": False}, {})
  assert R._claim("x", True, {}, runs=("fix", "grpo"), dyn=dyn)["from_transient"]
  assert not R._claim("x", True, {}, runs=("fix",), dyn=dyn)["from_transient"]
  assert not R._claim("Stage 1", True, {}, runs=(), dyn=dyn)["from_transient"]
  assert R._claim("x", True, {}, runs=("never_measured",), dyn=dyn)["from_transient"]
  assert R._at_end(dyn, "grpo") == (False, "transient (KL or conditional KL still moving)")


def test_the_documented_three_seeds_do_not_decide_and_five_clear_seeds_do():
  runs = _runs({"fix": [0.155, 0.171, 0.187], "grpo": [0.176, 0.340, 0.504]})
  dyn = _dyn({"fix": True, "grpo": True}, {})
  kl = R._versus_contrast(_job(), "fix", "grpo", runs, dyn)[0]
  assert not kl["holds"] and kl["numbers"]["p"] == pytest.approx(0.217, abs=0.01)
  assert kl["numbers"]["ci95"][0] < 0 < kl["numbers"]["ci95"][1] and "Welch p" in kl["why"]
  seeds5 = (0, 1, 2, 3, 4)
  runs = _runs({"fix": [0.15, 0.17, 0.16, 0.18, 0.17], "grpo": [2.5, 2.6, 2.55, 2.7, 2.4]},
               seeds=seeds5)
  kl = R._versus_contrast(_job(seeds5), "fix", "grpo", runs, dyn)[0]
  assert kl["holds"] and kl["numbers"]["p"] < 1e-6 and not kl["from_transient"]


def test_one_seed_gives_no_verdict_even_far_apart():
  runs = _runs({"fix": [0.1], "grpo": [3.0]}, seeds=(0,))
  kl = R._versus_contrast(_job((0,)), "fix", "grpo", runs, _dyn({"fix": True, "grpo": True}, {}))[0]
  assert not kl["holds"] and "fewer than 2 seeds" in kl["why"] and kl["numbers"]["seeds"] == [1, 1]


def test_matched_accuracy_reports_p_correct_reached_and_the_seeds_and_is_flagged():
  runs = _runs({"fix": [0.2, 0.2, 0.2], "grpo": [2.0, 2.1, 2.2]})
  matched = {"fix": [(0, _matched(0.93, 2.5)), (1, _matched(0.95, 2.4)), (2, _matched(0.85, 2.3))],
             "grpo": [(0, _matched(0.97, 0.1)), (1, _matched(0.91, 0.2)), (2, _matched(0.96, 0.15))]}
  out = R._versus_contrast(_job(), "fix", "grpo", runs, _dyn({"fix": True, "grpo": False}, matched))
  m = out[1]
  assert m["claim"].startswith("reward maximisation collapses: at P(correct) >= 0.9")
  n = m["numbers"]
  assert n["fix_p_correct"] == [0.93, 0.95] and n["fix_seeds_reached"] == [0, 1]
  assert n["grpo_p_correct"] == [0.97, 0.91, 0.96] and n["grpo_seeds_reached"] == [0, 1, 2]
  assert m["holds"] and n["p"] < 0.05
  assert m["from_transient"]  # grpo is still moving: the old code set this claim's flag to False


def test_each_configured_comparison_is_one_welch_claim():
  runs = _runs({"k0_disa": [0.18, 0.20, 0.19], "k2_disa": [5.0, 9.0, 7.0],
                "k0_grpo": [1.8, 1.9, 1.7], "k2_grpo": [1.85, 1.8, 1.9]})
  job = _job()
  job.cfg = SimpleNamespace(seeds=SEEDS, run_seeds=lambda m: SEEDS,
                            compare=("k0_disa<k2_disa", "k0_grpo<k2_grpo"), controls=(),
                            stage1=SimpleNamespace(label_scale="sum"))
  evals = {m: {} for m in ("k0_disa", "k2_disa", "k0_grpo", "k2_grpo")}
  s1 = {"n_study_mae_vs_exact": {"2": 0.6, "4": 0.4}}
  dyn = _dyn({"k0_disa": True, "k2_disa": False, "k0_grpo": True, "k2_grpo": True}, {})
  out = {c["claim"].split("'")[0]: c for c in R._claims(job, s1, evals, runs, dyn, None, [])}
  disa, grpo = out["k0_disa"], out["k0_grpo"]
  assert disa["holds"] and disa["numbers"]["p"] < 0.05 and disa["from_transient"]
  assert disa["runs"] == ["k0_disa", "k2_disa"]
  assert not grpo["holds"] and not grpo["from_transient"] and "Welch p" in grpo["why"]


def test_the_stage1_claim_is_made_only_against_an_exact_value_on_the_labels_scale():
  job = _job()
  job.cfg = SimpleNamespace(seeds=SEEDS, run_seeds=lambda m: SEEDS, compare=(), controls=(),
                            stage1=SimpleNamespace(label_scale="sum"))
  s1 = {"n_study_mae_vs_exact": {"2": 0.6, "4": 0.4}}
  dyn = _dyn({}, {})
  claims = [c["claim"] for c in R._claims(job, s1, {}, {}, dyn, None, [])]
  assert claims == ["Stage 1 error shrinks with N"]
  job.cfg.stage1.label_scale = "mean"  # (labels of the length-normalised residual)
  assert R._claims(job, s1, {}, {}, dyn, None, []) == []


def test_on_the_mean_scale_the_stage12_sections_print_no_error_against_the_exact_log_z():
  job = _job()
  job.cfg.stage1.label_scale = "mean"
  anchor = SimpleNamespace(embeddings=lambda: (("a", "b"), np.zeros((2, 4))), val_prompt_ids=("b",),
                           fit=SimpleNamespace(best_epoch=3, val_mse=0.2, val_r2=0.5),
                           history={"val_mse": [0.3, 0.2]})
  exact = SimpleNamespace(log_z_of=lambda ids: pytest.fail("the exact log Z read on the mean scale"))
  s2 = R._stage2_section(job, anchor, None, exact)
  assert s2 == {"best_epoch": 3, "val_mse_vs_labels": 0.2, "val_r2_vs_labels": 0.5, "n_val": 1,
                "val_mse_curve": [0.3, 0.2]}
  s1 = {"n": 4, "label_scale": "mean", "ess_median": 2.0, "cv2_median": 0.5,
        "proposal_accuracy": 0.8, "prompts_without_correct_sample": 0,
        "n_study_variance": {"2": 0.3, "4": 0.1}}
  md = "\n".join(R._stage12_md(s1, s2, None))
  assert "no exact value to compare with" in md and "| 4 | 0.1000 |" in md
  assert "log Z_IS - log Z" not in md and "sigma_g" not in md
