"""`disa_jax.codec` (issue 46): every artifact round-trips through encode / decode, the irregular
layouts keep their JSON shape and key order, and a bad file names the file, field and value."""
import json
import math

import numpy as np
import pytest

from disa_jax import codec, config
from disa_jax.anchor.frozen import AnchorMeta, EmbeddingSpec
from disa_jax.artifacts import ArtifactError, fields_equal
from disa_jax.checkpoint.selection import Choice, Selection
from disa_jax.workflows.split_validation import SplitManifest
from disa_jax.estimators.reward_transforms import RewardTransform
from disa_jax.eval.exact import MEASURES, ExactMeasures, ExactTarget
from disa_jax.eval.runner import BenchmarkResult
from disa_jax.pipeline.conditional_kls import ConditionalKL, ConditionalKLs
from disa_jax.pipeline.report_records import Claim, ClaimTest
from disa_jax.rl.config import TrainConfig
from disa_jax.rollout.types import SamplingParams
from disa_jax.workflows.evaluation import BenchmarkEval
from disa_jax.workflows.stage1 import Stage1Diagnostics, Stage1Result
from disa_jax.workflows.stage2 import FitSummary
from disa_jax.workflows.stage3 import Stage3Run

RT = RewardTransform(kind="affine", scale=2.0, shift=0.5)
Q = {"q00": 1.0, "q50": 2.0, "q100": float("nan")}


def _diag():
  return Stage1Diagnostics(
      prompts=2, samples=8, beta=15.0, label_scale="sum", reward_transform=RT,
      proposal_logprobs="raw", ess=Q, ess_fraction=Q, cv2=Q, max_weight_share=Q, log_z_is=Q,
      nonfinite_labels=1, nonfinite_prompt_ids=("p3",), share_no_reward=0.5, mean_reward=0.25,
      mean_response_tokens=3.0, grade_errors=0)


def _measures():
  return ExactMeasures(per_prompt=({"log_z": 1.0},), samples_per_prompt=4,
                       means={k: 0.5 for k in MEASURES} | {"kl_wrong": float("nan")})


def _bench():
  return BenchmarkEval(name="t", ability="math", metrics={"mean@2": 0.5}, prompt_ids=("a", "b"),
                       correct=np.asarray([[1, 0], [0, 1]]), k=2, n_problems=2, path="p",
                       method="m", sampling={"n": 2, "stop_token_ids": [2]}, diversity={},
                       exact=None)


def _roundtrip(obj, **given):
  back = codec.decode(type(obj), json.loads(json.dumps(codec.encode(obj))), "f.json", **given)
  assert fields_equal(back, obj), (back, obj)
  return back


@pytest.mark.parametrize("make", [
    lambda: RT, lambda: Choice(4, "best", "r", "x", 0.5), lambda: _diag(), lambda: _measures(),
    lambda: _bench(), lambda: Selection("m", ((0, 0.25), (2, 0.5))),
    lambda: SamplingParams(n=2, temperature=0.6, stop_token_ids=(2, 3)),
    lambda: FitSummary(1, 0.1, None, 0.5, 2, 1),
    lambda: ExactTarget(("a", "b"), [1.0, 2.0], [0.1, 0.2], [0.3, 0.4], beta=2.0),
    lambda: AnchorMeta(embedding=EmbeddingSpec("model_mean_pool", 2, "ref"), beta=15.0,
                       reward_transform=RT, label_scale="sum", hidden_sizes=(8, 4)),
    lambda: Claim(claim="c", holds=False, numbers={"n": 1}, why="why", runs=("disa",),
                  from_transient=True, verdict="undecided", state="-",
                  test=ClaimTest(name="welch", p=0.1, direction_ok=True, summary="s", p_holm=0.2)),
    lambda: SplitManifest("s", "h", 3, 0, 1, "t", 2, "x", "v", 1, "y", ("a",))])
def test_artifacts_round_trip(make):
  _roundtrip(make())


def test_given_fields_are_not_read(tmp_path):
  run = Stage3Run(workdir=tmp_path, steps_run=4, start_step=0, final=None, export=None,
                  preempted=3, selection=Selection("m"), export_checkpoint=None,
                  stop_token_ids=(2,))
  assert _roundtrip(run, workdir=tmp_path).workdir == tmp_path
  s1 = Stage1Result(output_dir=tmp_path, preempted=False, diagnostics=_diag(), run=None,
                    dataset=tmp_path / "d.jsonl", stop_token_ids=(2,))
  _roundtrip(s1, output_dir=tmp_path)


def test_irregular_layouts_keep_their_json_shape():
  assert codec.encode(Selection("m", ((0, 0.25), (2, 0.5)))) == {
      "metric": "m", "scores": [[0, 0.25], [2, 0.5]], "best_step": 2, "best_value": 0.5}
  assert codec.encode(_bench()) == {
      "name": "t", "ability": "math", "metrics": {"mean@2": 0.5},
      "per_prompt": [{"prompt_id": "a", "correct": [1, 0]}, {"prompt_id": "b", "correct": [0, 1]}],
      "k": 2, "n_problems": 2, "path": "p", "method": "m",
      "sampling": {"n": 2, "stop_token_ids": [2]}, "diversity": {}}
  enc = codec.encode(_diag())
  assert list(enc) == ["prompts", "samples", "beta", "label_scale", "reward_transform",
                       "proposal_logprobs", "ess", "ess_fraction", "cv2", "max_weight_share",
                       "log_z_is", "nonfinite_labels", "share_no_reward", "mean_reward",
                       "mean_response_tokens", "grade_errors"]
  assert enc["nonfinite_labels"] == {"count": 1, "prompt_ids": ["p3"]}
  assert list(codec.encode(_measures())) == ["per_prompt", "samples_per_prompt", *MEASURES]
  assert list(codec.encode(_measures(), omit=("per_prompt",)))[0] == "samples_per_prompt"
  res = BenchmarkResult(name="b", ability="math", metrics={"x": 1.0}, prompt_ids=["p"],
                        correct=np.asarray([[True, False]]), responses=[["r", "s"]], answers=None)
  assert codec.encode(res) == {"name": "b", "ability": "math", "metrics": {"x": 1.0},
                               "per_prompt": [{"prompt_id": "p", "correct": [1, 0]}]}
  pre = Stage1Result(output_dir=None, preempted=True, diagnostics=None, run={"a": 1},
                     dataset="d", stop_token_ids=())
  assert pre.to_json() == {"preempted": True, "run": {"a": 1}, "dataset": "d"}


def test_conditional_kls_rows(tmp_path):
  mask = np.asarray([False, True])
  ckl = ConditionalKLs(tmp_path / "c.json", ("a", "b"), ("b",), "r", "p",
                       {"m": ConditionalKL("m", "i", [0.1, 0.2], [0.3, 0.4], mask)})
  ckl.save()
  row = json.loads((tmp_path / "c.json").read_text())["rows"]["m"]
  assert list(row) == ["model_path", "model_identity", "kl_target_correct",
                       "kl_proposal_correct", "kl_target_correct_mean",
                       "kl_proposal_correct_mean", "kl_target_correct_mean_heldout",
                       "kl_proposal_correct_mean_heldout"]
  back = ConditionalKLs.load(tmp_path / "c.json")
  assert np.array_equal(back.rows["m"].heldout, mask)
  assert fields_equal(back.rows["m"], ckl.rows["m"])


def test_old_records_take_defaults_and_derived_values():
  assert codec.decode(RewardTransform, {"kind": "raw", "scale": 1.0, "shift": 0.0, "eps": 0.1},
                      "f").ddof == 0
  claim = {"claim": "c", "holds": True, "numbers": {}, "why": None, "runs": [],
           "from_transient": False}
  assert codec.decode(Claim, claim, "f").verdict == "holds"
  assert codec.decode(Claim, claim | {"holds": False}, "f").verdict == "does NOT hold"
  assert math.isnan(codec.decode(ExactMeasures, codec.encode(_measures()), "f")["kl_wrong"])


@pytest.mark.parametrize("obj,cls,message", [
    ({"metric": "m"}, Selection, r"f.json: field 'scores' is missing"),
    ({"metric": 3, "scores": []}, Selection, r"f.json: field 'metric' must be str, got int 3"),
    ({"metric": "m", "scores": [[1.5, 0.1]]}, Selection,
     r"f.json: field 'scores\[0\]\[0\]' must be int, got float 1.5"),
    ({"kind": "raw", "bogus": 1}, RewardTransform, r"f.json: unknown fields \['bogus'\]"),
    ({"kind": "cubic"}, RewardTransform, r"f.json: RewardTransform.kind must be one of"),
    ({"prompt_ids": ["a"], "log_z": [1.0, 2.0], "target_entropy_correct": [1.0],
      "p_correct_ref": [1.0], "beta": 1.0}, ExactTarget,
     r"f.json: field 'log_z' must hold 1 numbers"),
    ({"prompt_ids": ["a"], "log_z": ["x"], "target_entropy_correct": [1.0],
      "p_correct_ref": [1.0], "beta": 1.0}, ExactTarget,
     r"f.json: field 'log_z' must be a list of numbers"),
    ({"best_epoch": 1, "train_mse": True, "val_mse": None, "val_r2": None, "n_train": 1,
      "n_val": 0}, FitSummary, r"f.json: field 'train_mse' must be float, got bool True"),
    ({"name": "t", "ability": "a", "metrics": {}, "per_prompt": [{"prompt_id": "a"}]},
     BenchmarkEval, r"f.json: field 'per_prompt\[0\].correct' is missing"),
    ({**codec.encode(_diag()), "nonfinite_labels": {"count": 1}}, Stage1Diagnostics,
     r"f.json: field 'nonfinite_labels.prompt_ids' is missing"),
    ({**codec.encode(_diag()), "reward_transform": {"kind": "raw", "x": 1}}, Stage1Diagnostics,
     r"f.json: unknown fields \['x'\] in 'reward_transform'"),
    ({**codec.encode(_measures()), "tb_sq": "0.1"}, ExactMeasures,
     r"f.json: field 'tb_sq' must be float, got str '0.1'"),
    ([1], FitSummary, r"f.json holds a JSON list, not an object"),
])
def test_errors_name_the_file_the_field_and_the_value(obj, cls, message):
  with pytest.raises(ArtifactError, match=message):
    codec.decode(cls, obj, "f.json")


def test_load_names_a_missing_or_unreadable_file(tmp_path):
  with pytest.raises(ArtifactError, match="the thing: .*x.json does not exist"):
    codec.load(Selection, tmp_path / "x.json", "the thing")
  (tmp_path / "x.json").write_text("{")
  with pytest.raises(ArtifactError, match="x.json is not readable JSON"):
    codec.load(Selection, tmp_path / "x.json", "the thing")


def test_a_field_added_since_is_left_out_of_configs_and_artifacts_alike_while_it_holds_omit():
  """One rule for both writers: `codec.encode` (artifacts) and `config.to_dict` (configs and the
  identity files built from them) leave out a field while it holds its ``omit`` value, so an
  identity recorded before the field existed still matches; any other value is recorded."""
  from disa_jax import config as config_lib
  from disa_jax.eval.exact import ExactTargetConfig
  assert "wrong_samples" not in config_lib.to_dict(ExactTargetConfig())
  assert config_lib.to_dict(ExactTargetConfig(wrong_samples=8))["wrong_samples"] == 8
  assert config_lib.from_mapping(ExactTargetConfig, config_lib.to_dict(ExactTargetConfig())
                                 ) == ExactTargetConfig()
  assert "wrong_samples_per_prompt" not in codec.encode(_measures())


# Issue 64, item 3: configs are read by the same walk (`config.from_mapping` = `codec.read_config`).
# The messages below are those of the separate converter config.py held before (82d599f).
@pytest.mark.parametrize("data, message", [
    ({"nope": 1}, "config: unknown field(s) ['nope']; known fields: ['checkpoint', 'log_every', "
     "'objective', 'optim', 'progress_bar', 'replay', 'rollout', 'seed', 'shuffle', "
     "'tensorboard', 'total_steps', 'validation', 'wandb']"),
    ({"total_steps": True}, "config.total_steps must be int, got True"),
    ({"optim": {"lr": float("nan")}}, "config.optim.lr must be a finite number, got nan"),
    ({"optim": 3}, "config.optim must be a mapping of fields, got int: 3"),
    ({"objective": "disa"}, "config.objective must be a mapping with a 'name' in ('disa', "
     "'disa_centred', 'flowrl', 'grpo', 'gspo', 'replay_sft', 'vargrad'), got 'disa'"),
    ({"objective": {"name": "ppo"}}, "config.objective.name must be one of ('disa', "
     "'disa_centred', 'flowrl', 'grpo', 'gspo', 'replay_sft', 'vargrad'), got 'ppo'"),
    ({"objective": {"name": "disa", "beta": -1.0}}, "config.objective: beta must be > 0, got -1.0"),
    ({"total_steps": -2}, "config: train.total_steps must be >= 1, got -2"),
    ({"rollout": {"group_size": "8"}}, "config.rollout.group_size must be int, got '8'"),
])
def test_a_config_is_read_by_the_codec_with_the_config_messages(data, message):
  with pytest.raises(ValueError) as e:
    config.from_mapping(TrainConfig, data)
  assert str(e.value) == message and not isinstance(e.value, ArtifactError)


def test_a_tagged_union_writes_its_tag_first_and_reads_back_its_subclass():
  """The Stage 3 objective (``JSON_TAG`` / ``JSON_VARIANTS``): one walk for a config file and a
  JSON artifact (before, only config.py's ``to_config`` / ``from_config`` knew the tag)."""
  cfg = config.from_mapping(TrainConfig, {"objective": {"name": "grpo", "eps_high": 0.28},
                                          "rollout": {"group_size": 4}})
  enc = codec.encode(cfg)
  assert list(enc["objective"])[:2] == ["name", "eps_low"] and enc == config.to_dict(cfg)
  back = codec.decode(TrainConfig, json.loads(json.dumps(enc)), "t.json")
  assert back == cfg and type(back.objective) is type(cfg.objective)
  with pytest.raises(ArtifactError, match=r"^t\.json: field 'objective\.name' must be one of "):
    codec.decode(TrainConfig, {**enc, "objective": {"name": "ppo"}}, "t.json")


def test_a_mapping_of_mappings_of_records_and_a_key_holding_a_dot_are_read_as_records():
  """`pipeline.report_records.Grid`: per regime a tuple of `SigmaPoint`s, per method a `RunFigures`
  whose ``steps_to_0.9`` is one key (not a nested object)."""
  from disa_jax.pipeline.report_records import Grid, RunFigures, SigmaPoint
  fig = {"mean": 1.0, "std": 0.0, "ci95": None, "n": 1}
  run = {"seeds": 1, "reached": 1, "steps_to_0.9": dict(fig, mean=40.0), "kl": fig,
         "kl_correct": fig, "grad_sq": fig, "grad_sq_median": fig}
  point = {"run": "disa", "sigma": 0.2, "kl": 0.3, "kl_std": 0.0, "seeds": 1, "loss_gap": 0.1,
           "envelope": 0.5}
  grid = codec.decode(Grid, {"regimes": {"disa": "sum"}, "figures": {"disa": run},
                             "sigma_curve": {"sum": [point]}}, "report.json", "grid")
  assert isinstance(grid.figures["disa"], RunFigures)
  assert grid.figures["disa"].steps_to_level.mean == 40.0
  assert grid.sigma_curve["sum"] == (SigmaPoint(**point),)
