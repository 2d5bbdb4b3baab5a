"""The stage artifacts (issue 28, item 1): each round-trips through its files, and a missing or
corrupt file raises `ArtifactError` naming the file (and the field)."""
import json

import numpy as np
import pytest

from disa_jax import codec
from disa_jax.anchor.frozen import EmbeddingSpec
from disa_jax.artifacts import ArtifactError
from disa_jax.checkpoint.selection import Choice, Selection
from disa_jax.eval.exact import MEASURES, ExactMeasures, ExactTarget, correct_set_terms
from disa_jax.estimators.reward_transforms import RewardTransform
from disa_jax.sft.baseline import SUMMARY_FILE
from disa_jax.workflows.evaluation import BenchmarkEval, EvalResult
from disa_jax.workflows.nstudy import NStudyResult
from disa_jax.workflows.sft import SftRun
from disa_jax.workflows.stage1 import Stage1Diagnostics, Stage1Result
from disa_jax.workflows.stage2 import AnchorArtifact, FitSummary
from disa_jax.workflows.stage3 import SERIES_FIELDS, ExactSeries, Stage3Run


def _exact():
  lp = {"sum0000": np.log([0.2, 0.1]), "sum0001": np.log([0.05, 0.3, 0.1])}
  return ExactTarget.from_logprobs(lp, 2.0)


def test_exact_target_round_trips_and_keeps_the_json_format(tmp_path):
  ex = _exact()
  assert ex.log_z.shape == (2,) and ex.beta == 2.0
  t = correct_set_terms(np.log([0.2, 0.1]), np.log([0.2, 0.1]), 2.0)
  assert ex.log_z[0] == t.log_z and ex.p_correct_ref[0] == t.p_correct_ref
  codec.save(ex, tmp_path / "exact.json")
  assert codec.load(ExactTarget, tmp_path / "exact.json", "the exact target") == ex
  raw = json.loads((tmp_path / "exact.json").read_text())  # the main job's exact.json keys
  assert list(raw) == ["prompt_ids", "log_z", "target_entropy_correct", "p_correct_ref", "beta"]
  assert ex.log_z_by_id() == dict(zip(raw["prompt_ids"], raw["log_z"]))
  np.testing.assert_array_equal(ex.log_z_of(["sum0001", "sum0000"]), ex.log_z[::-1])
  with pytest.raises(KeyError, match="sum0009"):
    ex.log_z_of(["sum0009"])


def test_exact_target_missing_or_corrupt_file_names_it(tmp_path):
  path = tmp_path / "exact.json"
  with pytest.raises(ArtifactError, match="exact.json does not exist"):
    codec.load(ExactTarget, path, "the exact target")
  path.write_text("{not json")
  with pytest.raises(ArtifactError, match="exact.json is not readable JSON"):
    codec.load(ExactTarget, path, "the exact target")
  codec.save(_exact(), path)
  raw = json.loads(path.read_text())
  path.write_text(json.dumps({k: v for k, v in raw.items() if k != "log_z"}))
  with pytest.raises(ArtifactError, match=r"exact.json: field 'log_z' is missing"):
    codec.load(ExactTarget, path, "the exact target")
  path.write_text(json.dumps(raw | {"p_correct_ref": [0.1]}))
  with pytest.raises(ArtifactError, match=r"exact.json: field 'p_correct_ref' must hold 2"):
    codec.load(ExactTarget, path, "the exact target")
  path.write_text(json.dumps(raw | {"beta": "2"}))
  with pytest.raises(ArtifactError, match=r"field 'beta' must be float"):
    codec.load(ExactTarget, path, "the exact target")


def _stage3_run(tmp_path):
  rows = [{"step": 1, "reward": 0.5}]
  for step in (2, 4):
    rows.append({"step": step, "reward": 0.7, **{f"exact/{f}": step * 1.0 for f in SERIES_FIELDS}})
  (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
  return Stage3Run(workdir=tmp_path, steps_run=4, start_step=0, final={"step": 4, "reward": 0.7},
                   export=tmp_path / "final",
                   export_checkpoint=Choice(step=4, which="best", reason="latest"), preempted=None,
                   selection=Selection("eval/mean@8", ((2, 0.5), (4, 0.75))), stop_token_ids=(2,))


def test_stage3_run_round_trips_with_its_metrics_and_exact_series(tmp_path):
  run = _stage3_run(tmp_path)
  run.save()
  assert Stage3Run.load(tmp_path) == run
  assert json.loads((tmp_path / "stage3_summary.json").read_text()) == run.to_json()
  assert [r["step"] for r in run.metrics()] == [1, 2, 4] and run.checkpoint_steps() == []
  series = run.exact_series()
  np.testing.assert_array_equal(series.step, [2, 4])
  np.testing.assert_array_equal(series["kl_mc"], [2.0, 4.0])
  assert series == ExactSeries.from_rows(run.metrics())


def test_stage3_run_missing_or_corrupt_summary_names_the_file(tmp_path):
  with pytest.raises(ArtifactError, match="stage3_summary.json does not exist"):
    Stage3Run.load(tmp_path)
  run = _stage3_run(tmp_path)
  run.save()
  raw = json.loads((tmp_path / "stage3_summary.json").read_text())
  (tmp_path / "stage3_summary.json").write_text(json.dumps(raw | {"steps_run": "4"}))
  with pytest.raises(ArtifactError, match=r"stage3_summary.json: field 'steps_run' must be int"):
    Stage3Run.load(tmp_path)
  (tmp_path / "stage3_summary.json").write_text(json.dumps(raw | {"selection": {"metric": "m"}}))
  with pytest.raises(ArtifactError,
                     match=r"stage3_summary.json: field 'selection.scores' is missing"):
    Stage3Run.load(tmp_path)
  (tmp_path / "metrics.jsonl").write_text('{"step": 2, "exact/kl_mc": 1.0}\n')
  with pytest.raises(ArtifactError, match=r"metrics.jsonl: step 2 lacks field 'exact/p_correct'"):
    run.exact_series()
  (tmp_path / "metrics.jsonl").write_text('{"step": 2\n')
  with pytest.raises(ArtifactError, match=r"metrics.jsonl line 1 is not JSON"):
    run.metrics()


def _measures():
  per = [{"log_z": 1.0, "kl_mc": 0.1, "tb_sq": 0.2}, {"log_z": 2.0, "kl_mc": 0.3, "tb_sq": 0.4}]
  return ExactMeasures(means={k: 0.5 for k in MEASURES} | {"kl_wrong": float("nan")},
                       samples_per_prompt=4, per_prompt=tuple(per))


def _eval_result(out_dir):
  task = BenchmarkEval(name="task", ability="sum_task", path="p.jsonl", method="disa", k=2,
                       n_problems=2, metrics={"mean@2": 0.5}, prompt_ids=("a", "b"),
                       correct=np.asarray([[1, 0], [0, 0]]),
                       sampling={"n": 2, "stop_token_ids": [2]}, diversity={}, exact=_measures())
  return EvalResult(output_dir=out_dir, method="disa", model_path="m",
                    checkpoint=Choice(step=4, which="best", reason="r", metric="x", value=0.5),
                    tables={"mean@2": {"task": 0.5}}, evaluated_now=("task",),
                    benchmarks={"task": task})


def test_eval_result_round_trips_through_summary_and_benchmark_files(tmp_path):
  res = _eval_result(tmp_path)
  res.benchmarks["task"].save(tmp_path)
  res.save()
  back = EvalResult.load(tmp_path)
  assert back == res and back.benchmarks["task"].exact.per_prompt_values("tb_sq").tolist() == [0.2, 0.4]
  summary = json.loads((tmp_path / "summary.json").read_text())
  assert summary["stop_token_ids"] == {"task": [2]} and "per_prompt" not in summary["exact"]["task"]
  assert json.loads((tmp_path / "task.json").read_text())["per_prompt"][0] == {
      "prompt_id": "a", "correct": [1, 0]}


def test_eval_result_missing_or_corrupt_file_names_it(tmp_path):
  with pytest.raises(ArtifactError, match="summary.json does not exist"):
    EvalResult.load(tmp_path)
  res = _eval_result(tmp_path)
  res.save()
  with pytest.raises(ArtifactError, match="benchmark 'task': .*task.json does not exist"):
    EvalResult.load(tmp_path)
  res.benchmarks["task"].save(tmp_path)
  raw = json.loads((tmp_path / "task.json").read_text())
  del raw["exact"]["tb_sq"]
  (tmp_path / "task.json").write_text(json.dumps(raw))
  with pytest.raises(ArtifactError, match=r"task.json: field 'exact.tb_sq' is missing"):
    EvalResult.load(tmp_path)
  (tmp_path / "task.json").write_text(json.dumps(raw | {"k": 2.5}))
  with pytest.raises(ArtifactError, match=r"task.json: field 'k' must be int"):
    EvalResult.load(tmp_path)


def _sft_summary(out_path):
  return {"num_prompts": 3, "num_samples": 24, "num_kept": 5, "steps": 2, "loss_first": 2.5,
          "loss_last": 1.5, "packing_efficiency": 0.9, "config": {"rank": 4},
          "out_path": str(out_path), "seconds": 1.0, "skipped": False}


def test_sft_run_round_trips_through_sft_summary_json(tmp_path):
  (tmp_path / SUMMARY_FILE).write_text(json.dumps(_sft_summary(tmp_path)))
  run = SftRun.load(tmp_path)
  assert run.exported and not run.skipped and run.num_kept == 5 and run.loss_last == 1.5
  assert run.to_json() == _sft_summary(tmp_path)
  assert SftRun.from_json(run.to_json(), "x", tmp_path) == run
  stopped = SftRun.from_json({"preempted": 3, "out_path": str(tmp_path), "skipped": False}, "x",
                             tmp_path)
  assert not stopped.exported and SftRun.from_json(stopped.to_json(), "x", tmp_path) == stopped


def test_sft_run_missing_or_corrupt_summary_names_the_file(tmp_path):
  with pytest.raises(ArtifactError, match="sft_summary.json does not exist"):
    SftRun.load(tmp_path)
  (tmp_path / SUMMARY_FILE).write_text(json.dumps(_sft_summary(tmp_path) | {"num_kept": None}))
  with pytest.raises(ArtifactError, match=r"sft_summary.json: field 'num_kept' must be int"):
    SftRun.load(tmp_path)


def _anchor_artifact(out_dir):
  return AnchorArtifact(
      output_dir=out_dir, anchor_path=out_dir / "anchor", stage1_path="s1.jsonl", prompts=3,
      prompts_fitted=3, samples_per_prompt=4, dropped_nonfinite=(),
      embedding=EmbeddingSpec(source="model_mean_pool", dim=2, model_path="ref",
                              prompt_format="stage1_prompt", rendering="plain"),
      beta=15.0, label_scale="sum", labels="plain", weighting="uniform",
      reward_transform=RewardTransform(kind="raw"), label_stats={"mean": 1.0, "std": 0.5},
      fit=FitSummary(best_epoch=1, train_mse=0.1, val_mse=0.2, val_r2=0.5, n_train=2, n_val=1),
      val_prompt_ids=("c",), sigma_g_train=0.3, sigma_g_val=0.4,
      history={"train_mse": [0.2, 0.1], "val_mse": [0.3, 0.2], "val_r2": [0.1, 0.5]},
      validation_curve=str(out_dir / "validation_curve.png"), resumed=False)


def test_anchor_artifact_round_trips_with_its_embedding_cache(tmp_path):
  art = _anchor_artifact(tmp_path)
  art.save()
  assert AnchorArtifact.load(tmp_path) == art
  (tmp_path / "embeddings_ids.json").write_text(json.dumps({"prompt_ids": ["a", "b", "c"]}))
  np.save(tmp_path / "embeddings.npy", np.ones((3, 2), np.float32))
  ids, emb = art.embeddings()
  assert ids == ("a", "b", "c") and emb.shape == (3, 2)


def test_anchor_artifact_missing_or_corrupt_file_names_it(tmp_path):
  with pytest.raises(ArtifactError, match="stage2_summary.json does not exist"):
    AnchorArtifact.load(tmp_path)
  art = _anchor_artifact(tmp_path)
  art.save()
  raw = json.loads((tmp_path / "stage2_summary.json").read_text())
  (tmp_path / "stage2_summary.json").write_text(json.dumps(raw | {"fit": {"best_epoch": 1}}))
  with pytest.raises(ArtifactError, match=r"stage2_summary.json: field 'fit.train_mse' is missing"):
    AnchorArtifact.load(tmp_path)
  with pytest.raises(ArtifactError, match="embeddings_ids.json does not exist"):
    art.embeddings()
  (tmp_path / "embeddings_ids.json").write_text(json.dumps({"prompt_ids": ["a", "b"]}))
  np.save(tmp_path / "embeddings.npy", np.ones((3, 2), np.float32))
  with pytest.raises(ArtifactError, match=r"embeddings.npy: shape \(3, 2\) is not \[P = 2, D\]"):
    art.embeddings()


def _stage1_result(out_dir):
  q = {"q00": 1.0, "q25": 1.5, "q50": 2.0, "q75": 2.5, "q100": 3.0}
  diag = Stage1Diagnostics(
      prompts=2, samples=8, beta=15.0, label_scale="sum", reward_transform=RewardTransform(kind="raw"),
      proposal_logprobs="raw", ess=q, ess_fraction=q, cv2=q, max_weight_share=q, log_z_is=q,
      nonfinite_labels=0, nonfinite_prompt_ids=(), share_no_reward=0.5, mean_reward=0.25,
      mean_response_tokens=3.0, grade_errors=0)
  return Stage1Result(output_dir=out_dir, dataset=out_dir / "stage1.jsonl", preempted=False,
                      run={"prompts_done": 2.0, "seconds": 1.0}, stop_token_ids=(2,),
                      diagnostics=diag)


def test_stage1_and_nstudy_results_round_trip(tmp_path):
  s1 = _stage1_result(tmp_path / "stage1")
  (tmp_path / "stage1").mkdir()
  s1.save()
  assert Stage1Result.load(tmp_path / "stage1") == s1
  raw = json.loads((tmp_path / "stage1" / "stage1_summary.json").read_text())
  assert list(raw)[:2] == ["prompts", "samples"] and raw["stop_token_ids"] == [2]
  study = {"prompts": 2, "prompts_with_full_pool": 2, "pool_size": 4, "repeats": 3,
           "per_m": [{"M": 2, "variance_mean": 0.5}, {"M": 8, "variance_mean": 0.1}],
           "variance_reduction_2_to_8": 0.8}
  (tmp_path / "nstudy.json").write_text(json.dumps(study))
  (tmp_path / "subset.json").write_text(json.dumps({"k": 3}))
  ns = NStudyResult.load(tmp_path)
  assert ns.study_json() == study and ns.k == 3 and ns.stage1 == s1
  assert ns.relative_bias_change_8_to_16 is None and ns.to_json()["stage1"] == raw


def test_stage1_and_nstudy_missing_or_corrupt_files_name_them(tmp_path):
  with pytest.raises(ArtifactError, match="stage1_summary.json does not exist"):
    Stage1Result.load(tmp_path)
  s1 = _stage1_result(tmp_path / "stage1")
  (tmp_path / "stage1").mkdir()
  s1.save()
  path = tmp_path / "stage1" / "stage1_summary.json"
  raw = json.loads(path.read_text())
  path.write_text(json.dumps(raw | {"ess": [1.0]}))
  with pytest.raises(ArtifactError, match=r"stage1_summary.json: field 'ess' must be dict"):
    Stage1Result.load(tmp_path / "stage1")
  s1.save()
  with pytest.raises(ArtifactError, match="subset.json does not exist"):
    NStudyResult.load(tmp_path)
  (tmp_path / "subset.json").write_text(json.dumps({"k": 3}))
  (tmp_path / "nstudy.json").write_text(json.dumps({"prompts": 2}))
  with pytest.raises(ArtifactError,
                     match=r"nstudy.json: field 'prompts_with_full_pool' is missing"):
    NStudyResult.load(tmp_path)
