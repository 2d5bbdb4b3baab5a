"""`pipeline.report` on made-up numbers: the table of the preference among correct answers, and
the `JobReport` artifact read back from a report.json."""
import json

import numpy as np
import pytest

from disa_jax import artifacts
from disa_jax.pipeline import report_md as MD
from disa_jax.pipeline.job_report import Claim, JobReport
from disa_jax.pipeline.conditional_kls import ConditionalKL, ConditionalKLs


def _preference(tmp_path, heldout):
  ids = ("sum_task/0", "sum_task/1", "sum_task/2")
  mask = np.asarray([p in heldout for p in ids])
  rows = {"reference": ConditionalKL("ref", "r#1", [0.0, 0.0, 0.0], [0.5, 0.7, 0.9], mask),
          "disa": ConditionalKL("disa", "d#1", [0.1, 0.2, 0.6], [0.3, 0.4, 0.2], mask)}
  return ConditionalKLs(tmp_path / "conditional_kl.json", ids, tuple(heldout), "r#1", "p#1", rows)


def test_the_preference_table_without_a_split(tmp_path):
  md = MD.conditional_kl_md(_preference(tmp_path, ()).report_section())
  assert md[0] == "## Preference among correct answers"
  assert "| model | KL(pi\\|c ‖ pi~\\|c) | KL(pi\\|c ‖ p_T\\|c) |" in md
  assert "| reference | 0.0000 | 0.7000 |" in md and "| disa | 0.3000 | 0.3000 |" in md
  assert MD.conditional_kl_md(None) == []


def test_the_preference_table_with_held_out_prompts(tmp_path):
  section = _preference(tmp_path, ("sum_task/2",)).report_section()
  assert section["disa"] == pytest.approx({
      "kl_target_correct_mean": 0.15, "kl_proposal_correct_mean": 0.35,
      "kl_target_correct_mean_heldout": 0.6, "kl_proposal_correct_mean_heldout": 0.2})
  md = MD.conditional_kl_md(section)
  assert ("| model | KL(pi\\|c ‖ pi~\\|c), training prompts | KL(pi\\|c ‖ p_T\\|c), training prompts | "
          "KL(pi\\|c ‖ pi~\\|c), held-out prompts | KL(pi\\|c ‖ p_T\\|c), held-out prompts |") in md
  assert "| disa | 0.1500 | 0.3500 | 0.6000 | 0.2000 |" in md


def _report_json(**over):
  claim = {"claim": "Stage 1 error shrinks with N", "holds": True, "numbers": {"2": 0.3, "4": 0.1},
           "why": None, "runs": [], "from_transient": False}
  obj = {"config": {"beta": 15.0}, "regime": {"all_at_end_state": False, "per_method": {}},
         "stage1": {"n": 4, "pool": 8, "label_scale": "mean", "ess_median": 2.0, "cv2_median": 0.5,
                    "proposal_accuracy": 0.8, "prompts_without_correct_sample": 0,
                    "grade_errors": 0, "n_study_variance": {"2": 0.3}, "log_z_exact_mean": 12.0,
                    "log_z_exact_std": 1.5},
         "stage2": {"best_epoch": 3, "val_mse_vs_labels": 0.2, "val_r2_vs_labels": 0.5, "n_val": 2}, "anchor_study": None, "nstudy": None,
         "anchor_gap": None, "methods": {"disa": {"kl_to_target": 0.4}},
         "runs": {"disa": {"kl_to_target": 0.4}}, "end_state": {},
         "matched_accuracy": {}, "matched_accuracy_runs": {}, "stage3_seeds": [0],
         "run_seeds": {"disa": [0]}, "skipped_methods": {"lora_sft": "no reward-1 sample"},
         "claims": [claim], "times_s": {"stage1": 1.5}, "plots": ["training_curves.png"]}
  return obj | over


def test_job_report_loads_report_json(tmp_path):
  (tmp_path / "report.json").write_text(json.dumps(_report_json()))
  (tmp_path / "report.md").write_text("# the report\n")
  rep = JobReport.load(tmp_path)
  assert rep.dir == tmp_path and rep.json_path == tmp_path / "report.json"
  assert rep.markdown() == "# the report\n" and rep.conditional_kl is None
  assert rep.methods["disa"]["kl_to_target"] == 0.4 and rep.stage3_seeds == (0,)
  assert rep.claims == (Claim(claim="Stage 1 error shrinks with N", holds=True,
                              numbers={"2": 0.3, "4": 0.1}, why=None, runs=(),
                              from_transient=False, verdict="holds"),)  # (from before issue 44)
  current = dict(_report_json()["claims"][0], verdict="undecided", holds=False, state="-",
                 test=None, why="no paired test")
  (tmp_path / "report.json").write_text(json.dumps(_report_json(claims=[current])))
  back = JobReport.load(tmp_path).claims[0]
  assert (back.verdict, back.state, back.test, back.why) == ("undecided", "-", None, "no paired test")
  section = {"disa": {"kl_target_correct_mean": 0.1, "kl_proposal_correct_mean": 0.2}}
  (tmp_path / "report.json").write_text(json.dumps(_report_json(conditional_kl=section)))
  assert JobReport.load(tmp_path).conditional_kl == section


def test_job_report_errors_name_the_field(tmp_path):
  with pytest.raises(artifacts.ArtifactError, match="report.json does not exist"):
    JobReport.load(tmp_path)
  obj = _report_json()
  del obj["methods"]
  (tmp_path / "report.json").write_text(json.dumps(obj))
  with pytest.raises(artifacts.ArtifactError, match="field 'methods' is missing"):
    JobReport.load(tmp_path)
  bad_claim = dict(_report_json()["claims"][0], holds="yes")
  (tmp_path / "report.json").write_text(json.dumps(_report_json(claims=[bad_claim])))
  with pytest.raises(artifacts.ArtifactError,
                     match=r"report.json: field 'claims\[0\].holds' must be bool"):
    JobReport.load(tmp_path)


def test_the_report_keeps_only_its_own_jobs_times():
  # A workdir another preset ran first keeps that preset's runs in times.json (claims reusing
  # claims_quick's 5-seed runs: seeds 3-4 of disa_exact are not the claims preset's).
  from disa_jax.pipeline.sum_job import job_times
  times = {"models": 1.0, "stage1": 2.0, "stage1_data1": 3.0, "stage2_data2": 4.0,
           "stage3_disa": 5.0, "stage3_disa_exact_seed3": 6.0, "eval_reference": 7.0,
           "eval_disa_exact_seed3": 8.0, "lora_sft": 9.0}
  rows = {"reference": "r", "proposal": "p", "disa": "d"}
  assert job_times(times, rows, {0: None, 1: None}) == {
      "models": 1.0, "stage1": 2.0, "stage1_data1": 3.0, "stage3_disa": 5.0,
      "eval_reference": 7.0, "lora_sft": 9.0}


def test_the_header_names_where_the_models_came_from():
  """report.md's header reads the report's provenance: a pinned job names its store entry, a job
  that trained its models names the processor (and a pin that holds others); an old report
  without provenance keeps its sentence."""
  fp = {"reference": "a" * 64, "proposal": "b" * 64}
  prov = {"models": {"source": "pinned", "key": "d1c41785495c3ee5", "fingerprint": fp,
                     "pinned_fingerprint": fp},
          "packages": {"jax": "0.10.2"}, "python": "3.11.7", "cpu": "AMD EPYC"}
  assert "store entry d1c41785495c3ee5" in MD.models_origin(MD._provenance({"provenance": prov}))
  prov["models"] |= {"source": "trained", "pinned_fingerprint": {"reference": "c" * 64,
                                                                 "proposal": "b" * 64}}
  text = MD.models_origin(MD._provenance({"provenance": prov}))
  assert text == "trained on this machine (AMD EPYC); the pin d1c41785495c3ee5 holds others"
  prov["models"] |= {"key": "", "pinned_fingerprint": {}}
  assert MD.models_origin(MD._provenance({"provenance": prov})) == "trained on this machine (AMD EPYC)"
  assert MD.models_origin(MD._provenance({"provenance": {}})) == \
      "trained here and reloaded from HF checkpoints"
