"""Every resumable stage records the identity of its inputs and, on a rerun, resumes the same work
or refuses naming every differing field (``overwrite=True`` discards): Stage 1, Stage 2 (finding 7:
its stored summary was returned whatever the Stage 1 file or label variant), Stage 3, the SFT
baseline and evaluation (finding 7: a benchmark's old numbers were reported for another model)."""
import dataclasses
import json
import shutil

import numpy as np
import pytest

from configs import eval_paper, sft_paper, stage2_paper, stage3_paper
from disa_jax.checkpoint.identity import IdentityMismatchError
from disa_jax.checkpoint.lock import OutputLock, OutputLockedError
from disa_jax.rollout.types import Completion
from disa_jax.workflows import stage1 as stage1_lib
from disa_jax.workflows.evaluation import EvalConfig, run_evaluation
from disa_jax.workflows.sft import SftConfig, claim_sft_output, run_sft
from disa_jax.workflows.stage2 import Stage2Config, run_stage2
from disa_jax.workflows.stage3 import Stage3Config, claim_stage3_output, run_stage3
from tests.workflows.test_workflow_units import _s1, write_stage1_run


def _files(tmp_path):
  prompts = tmp_path / "prompts.jsonl"
  prompts.write_text('{"prompt": "p"}\n')
  ref, prop = tmp_path / "ref", tmp_path / "prop"
  for d, w in ((ref, b"ref"), (prop, b"prop")):
    d.mkdir()
    (d / "model.safetensors").write_bytes(w)
  return str(prompts), str(ref), str(prop)


def test_stage1_refuses_other_inputs_naming_every_field_and_overwrite_discards(tmp_path):
  prompts, ref, prop = _files(tmp_path)
  out = tmp_path / "s1"
  cfg = stage1_lib.Stage1Config.from_config(_s1(output_dir=str(out), prompts_path=prompts,
                                                reference_path=ref, proposal_path=prop))
  assert stage1_lib.claim_stage1_output(cfg) == "new"
  assert stage1_lib.claim_stage1_output(cfg) == "resumed"
  cfg.dataset_path().mkdir()  # the first run's labels
  (cfg.dataset_path() / "part-000000.parquet").write_bytes(b"old labels")
  (tmp_path / "prop" / "model.safetensors").write_bytes(b"another proposal, same path")
  with pytest.raises(IdentityMismatchError) as e:  # refused before any model is loaded
    stage1_lib.run_stage1(dataclasses.replace(cfg, beta=10.0))
  assert set(e.value.diffs) == {"proposal_path.sha256", "beta"}
  assert "beta: stored 15.0, this run 10.0" in str(e.value)
  with pytest.raises(IdentityMismatchError, match="sampling"):
    stage1_lib.claim_stage1_output(
        dataclasses.replace(cfg, sampling=dataclasses.replace(cfg.sampling, n=4)))
  assert stage1_lib.claim_stage1_output(dataclasses.replace(cfg, overwrite=True)) == "overwritten"
  assert not cfg.dataset_path().exists()
  assert json.loads((out / "stage1_config.json").read_text())["overwrite"] is True


def _stage2_config(checkpoints, tmp_path, stage1_path, **over):
  c = stage2_paper.get_config("qwen3-4b-base,math")
  c.stage1_path, c.reference_path = stage1_path, checkpoints["reference"]
  c.anchor_path, c.output_dir = str(tmp_path / "anchor"), str(tmp_path / "s2")
  c.fit.epochs, c.fit.batch_size, c.fit.val_fraction = 2, 4, 0.0
  c.embedding.dtype, c.embedding.batch_size, c.embedding.pad_to = "float32", 8, 16
  c.embedding.mesh.num_devices = 1
  for k, v in over.items():
    c[k] = v
  return Stage2Config.from_config(c)


def test_stage2_does_not_serve_a_stored_anchor_fitted_on_other_inputs(checkpoints, tmp_path):
  samples = [[{"token_ids": [7, 8], "text": "ab", "logp_ref": -2.0 - j - i, "logp_proposal": -2.5,
               "reward": float(j % 2), "num_tokens": 2} for j in range(3)] for i in range(6)]
  path, _ = write_stage1_run(tmp_path, checkpoints["reference"], samples)
  first = run_stage2(_stage2_config(checkpoints, tmp_path, path))
  assert run_stage2(_stage2_config(checkpoints, tmp_path, path)).resumed
  with pytest.raises(IdentityMismatchError) as e:
    run_stage2(_stage2_config(checkpoints, tmp_path, path, weighting="inverse_variance",
                              samples=2))
  assert set(e.value.diffs) == {"weighting", "samples"}
  with open(path, "a") as f:  # Stage 1 gained a prompt: the same path, other content
    f.write(open(path).readline().replace('"q0"', '"q9"'))
  with pytest.raises(IdentityMismatchError, match="stage1_path.sha256"):
    run_stage2(_stage2_config(checkpoints, tmp_path, path))
  with OutputLock(tmp_path / "s2" / ".lock"):  # one Stage 2 run at a time
    with pytest.raises(OutputLockedError):
      run_stage2(_stage2_config(checkpoints, tmp_path, path))
  lines = open(path).read().splitlines(keepends=True)
  open(path, "w").write("".join(lines[:-1]))
  again = run_stage2(_stage2_config(checkpoints, tmp_path, path, labels="jensen", overwrite=True))
  assert not again.resumed and again.labels == "jensen" and first.labels == "plain"


def test_stage3_and_sft_refuse_a_changed_checkpoint_before_any_work(tmp_path):
  _, ref, _ = _files(tmp_path)
  train = tmp_path / "train.jsonl"
  train.write_text('{"prompt": "p"}\n')
  c = stage3_paper.get_config("grpo,qwen3-4b-base,math")
  c.workdir, c.model.policy_path, c.data.train_path = str(tmp_path / "run"), ref, str(train)
  c.data.validation_paths = ()  # the paper's held-out split is not made here
  cfg = Stage3Config.from_config(c)
  assert claim_stage3_output(cfg) == "new"
  (tmp_path / "run" / "checkpoints" / "1").mkdir(parents=True)
  (tmp_path / "ref" / "model.safetensors").write_bytes(b"trained further")
  with pytest.raises(IdentityMismatchError) as e:
    run_stage3(cfg)
  assert set(e.value.diffs) == {"policy_path.sha256", "reference_path.sha256"}
  assert claim_stage3_output(dataclasses.replace(cfg, overwrite=True)) == "overwritten"
  assert not (tmp_path / "run" / "checkpoints").exists()

  s = sft_paper.get_config("qwen2.5-7b")
  s.reference_path, s.stage1_path, s.out_path = ref, str(train), str(tmp_path / "sft" / "m")
  sft = SftConfig.from_config(s)
  assert claim_sft_output(sft) == "new"
  (tmp_path / "sft" / "m.ckpt").mkdir()
  train.write_text('{"prompt": "q"}\n')
  with pytest.raises(IdentityMismatchError, match="stage1_path.sha256"):
    run_sft(sft)
  lr = dataclasses.replace(sft.sft, learning_rate=sft.sft.learning_rate * 2)
  with pytest.raises(IdentityMismatchError, match="sft"):
    claim_sft_output(dataclasses.replace(sft, sft=lr))


class _WeightEcho:
  """An engine whose samples depend on the weights loaded into it (a different model answers
  differently), with the interface `run_evaluation` uses."""

  def __init__(self):
    self.seed = None

  def update_weights(self, state_dict):
    self.seed = int(abs(float(np.asarray(state_dict["model.norm.weight"], np.float64).sum())) * 1e6)

  def generate(self, prompts, params):
    rng = np.random.default_rng(self.seed)
    return [[Completion(token_ids=rng.integers(5, 60, 3).astype(np.int32),
                        logprobs=np.full(3, -1.0, np.float32), raw_logprobs=None,
                        finish_reason="length") for _ in range(params.n)] for _ in prompts]


def test_evaluation_does_not_report_another_models_numbers(checkpoints, prompt_files, tmp_path):
  model = tmp_path / "policy"
  shutil.copytree(checkpoints["proposal"], model)
  c = eval_paper.get_config("math")
  c.model_path, c.output_dir, c.label = str(model), str(tmp_path / "ev"), "tiny"
  for name in c.benchmarks:
    c.benchmarks[name] = prompt_files.get(name, "")
  c.math_k, c.max_tokens = 2, 3
  cfg = EvalConfig.from_config(c)
  first = run_evaluation(cfg, engine=_WeightEcho())
  assert first.evaluated_now == ("math500",)
  assert run_evaluation(cfg, engine=_WeightEcho()).evaluated_now == ()  # the same model: reused
  responses = (tmp_path / "ev" / "math500_responses.jsonl").read_text()
  # Training moved on: the same path now holds other weights (as run_step=-1 picks a newer step).
  shutil.copy(f"{checkpoints['reference']}/model.safetensors", model / "model.safetensors")
  with pytest.raises(IdentityMismatchError) as e:
    run_evaluation(cfg, engine=_WeightEcho())
  assert set(e.value.diffs) == {"model_path.sha256"} and "math500.identity.json" in str(e.value)
  with pytest.raises(IdentityMismatchError, match="temperature"):
    run_evaluation(dataclasses.replace(cfg, temperature=1.0), engine=_WeightEcho())
  again = run_evaluation(dataclasses.replace(cfg, overwrite=True), engine=_WeightEcho())
  assert again.evaluated_now == ("math500",)
  assert (tmp_path / "ev" / "math500_responses.jsonl").read_text() != responses  # the new model's
