"""Identities by content, not location (issue 43, point 4): a run directory copied elsewhere with
its inputs (other absolute paths, the same bytes) resumes without ``overwrite``, its anchor is
taken by Stage 3, and identity files and checkpoints written before this change resume the same
way; another model under the same path is still refused."""
import dataclasses
import json
import shutil
from pathlib import Path

import pytest
from flax import nnx

from configs import stage2_paper, stage3_paper
from disa_jax import testing
from disa_jax.anchor import Anchor, AnchorMLP
from disa_jax.anchor.frozen import AnchorMeta, EmbeddingSpec
from disa_jax.checkpoint import identity
from disa_jax.checkpoint.identity import IdentityMismatchError, claim_output, fingerprint
from disa_jax.estimators import RewardTransform, load_stage1
from disa_jax.models import load_config
from disa_jax.rl.build import build_trainer
from disa_jax.workflows import stage1 as stage1_lib
from disa_jax.workflows.stage2 import Stage2Config, run_stage2
from disa_jax.workflows.stage3 import Stage3Config, claim_stage3_output, load_anchor
from tests.rl import test_trainer as tt
from tests.workflows.conftest import make_checkpoint
from tests.workflows.test_workflow_units import _s1, write_stage1_run

RT = RewardTransform(kind="group_zscore")


def _move(src: Path, dst: Path) -> None:
  """Copies ``src`` to ``dst`` and deletes ``src``: nothing can read the old place afterwards."""
  shutil.copytree(src, dst, symlinks=True)
  shutil.rmtree(src)


def _model(path: Path, weights: bytes) -> str:
  path.mkdir(parents=True)
  (path / "config.json").write_text('{"model_type": "qwen3"}')
  (path / "model.safetensors").write_bytes(weights)
  return str(path)


def test_inputs_are_compared_by_content_and_the_file_names_where_they_are_now(tmp_path):
  home, cluster = tmp_path / "home", tmp_path / "cluster"

  def ident(root, note=""):
    data, model = str(root / "train.jsonl"), str(root / "model")
    return {**identity.inputs(train_path=data, model_path=model),
            "data": {"train_path": data, "validation_paths": [data], "reward": "math"},
            "note": note or data, "beta": 15.0}

  _model(home / "model", b"weights")
  (home / "train.jsonl").write_text('{"prompt": "p"}\n')
  path = home / "out" / "identity.json"
  kw = dict(overwrite=False, has_output=True, discard=lambda: None)
  assert claim_output(path, ident(home, note="n"), **{**kw, "has_output": False}) == "new"
  _move(home, cluster)
  path = cluster / "out" / "identity.json"
  assert claim_output(path, ident(cluster, note="n"), **kw) == "resumed"
  stored = json.loads(path.read_text())  # rewritten: it names the inputs where they are now
  assert stored["model_path"] == str(cluster / "model")
  assert stored["data"]["validation_paths"] == [str(cluster / "train.jsonl")]
  with pytest.raises(IdentityMismatchError) as e:  # a string that is not a path-named entry
    claim_output(path, ident(cluster), **kw)
  assert set(e.value.diffs) == {"note"}
  changed = ident(cluster, note="n")
  changed["data"]["reward"] = "code"
  with pytest.raises(IdentityMismatchError) as e:
    claim_output(path, changed, **kw)
  assert set(e.value.diffs) == {"data"}
  (cluster / "model" / "model.safetensors").write_bytes(b"weightz")  # another model, same path
  with pytest.raises(IdentityMismatchError) as e:
    claim_output(path, ident(cluster, note="n"), **kw)
  assert set(e.value.diffs) == {"model_path.sha256"}


def test_copied_stage1_and_stage3_outputs_written_before_resume(tmp_path):
  """The identity files are those this code wrote before the change (the format is unchanged:
  each input's path and fingerprint); they resume at other paths when the content matches."""
  home, cluster = tmp_path / "home", tmp_path / "cluster"
  ref, prop = _model(home / "ref", b"ref"), _model(home / "prop", b"prop")
  (home / "prompts.jsonl").write_text('{"prompt": "p"}\n')
  s1 = lambda root: stage1_lib.Stage1Config.from_config(_s1(
      output_dir=str(root / "s1"), prompts_path=str(root / "prompts.jsonl"),
      reference_path=str(root / "ref"), proposal_path=str(root / "prop")))
  assert stage1_lib.claim_stage1_output(s1(home)) == "new"
  s1(home).dataset_path().mkdir()  # the labels
  c = stage3_paper.get_config("grpo,qwen3-4b-base,math")
  c.workdir, c.model.policy_path, c.model.reference_path = str(home / "run"), ref, prop
  c.data.train_path, c.data.validation_paths = str(home / "prompts.jsonl"), ()
  s3 = Stage3Config.from_config(c)
  assert claim_stage3_output(s3) == "new"
  (home / "run" / "checkpoints" / "1").mkdir(parents=True)
  old = json.loads((home / "run" / "identity.json").read_text())
  assert old["policy_path"] == ref and old["model"]["policy_path"] == ref  # path-based fields
  _move(home, cluster)
  assert stage1_lib.claim_stage1_output(s1(cluster)) == "resumed"
  moved = dataclasses.replace(
      s3, workdir=str(cluster / "run"), data=dataclasses.replace(
          s3.data, train_path=str(cluster / "prompts.jsonl")),
      model=dataclasses.replace(s3.model, policy_path=str(cluster / "ref"),
                                reference_path=str(cluster / "prop")))
  assert claim_stage3_output(moved) == "resumed"
  (cluster / "prop" / "model.safetensors").write_bytes(b"another reference")
  with pytest.raises(IdentityMismatchError) as e:
    claim_stage3_output(moved)
  assert set(e.value.diffs) == {"reference_path.sha256"}
  with pytest.raises(IdentityMismatchError) as e:
    stage1_lib.claim_stage1_output(s1(cluster))
  assert set(e.value.diffs) == {"proposal_path.sha256"}


def _anchor(spec: EmbeddingSpec) -> Anchor:
  meta = AnchorMeta(embedding=spec, beta=15.0, reward_transform=RT, label_scale="mean",
                    hidden_sizes=(8,))
  return Anchor(AnchorMLP(spec.dim, (8,), "relu", rngs=nnx.Rngs(0)), meta)


def test_an_anchor_takes_its_reference_by_content_and_an_older_one_by_path_or_content(tmp_path):
  ref = _model(tmp_path / "home" / "ref", b"ref")
  ok = dict(beta=15.0, reward_transform=RT, label_scale="mean")
  new = _anchor(EmbeddingSpec("model_mean_pool", 8, ref, model_sha256=fingerprint(ref)))
  old = _anchor(EmbeddingSpec("model_mean_pool", 8, ref))  # saved before model_sha256 existed
  copy = tmp_path / "cluster" / "ref"
  shutil.copytree(ref, copy)
  for anchor in (new, old):  # the recorded directory is still there: compared by content
    anchor.check_compatible(**ok, reference=str(copy))
  shutil.rmtree(ref)
  new.check_compatible(**ok, reference=str(copy))
  with pytest.raises(ValueError, match=r"EmbeddingSpec.model_path\), but the run's reference is "
                                       r".*saved before anchors did"):
    old.check_compatible(**ok, reference=str(copy))
  (copy / "model.safetensors").write_bytes(b"fine-tuned")  # another model under the same path
  with pytest.raises(ValueError, match=r"EmbeddingSpec.model_sha256=.* holds other content"):
    new.check_compatible(**ok, reference=str(copy))


def _stage2(root: Path, stage1_path: str) -> Stage2Config:
  c = stage2_paper.get_config("qwen3-4b-base,math")
  c.stage1_path, c.reference_path = stage1_path, str(root / "ref")
  c.anchor_path, c.output_dir = str(root / "anchor"), str(root / "s2")
  c.fit.epochs, c.fit.batch_size, c.fit.val_fraction = 2, 4, 0.0
  c.embedding.dtype, c.embedding.batch_size, c.embedding.pad_to = "float32", 8, 16
  c.embedding.mesh.num_devices = 1
  return Stage2Config.from_config(c)


def _stage3(root: Path, train: str) -> Stage3Config:
  c = stage3_paper.get_config("disa,qwen3-4b-base,math")
  c.workdir, c.model.policy_path = str(root / "run"), str(root / "ref")
  c.data.train_path, c.data.validation_paths = train, ()
  c.data.anchor_path, c.data.rendering = str(root / "anchor"), "plain"
  return Stage3Config.from_config(c)


def test_a_copied_stage2_run_resumes_and_stage3_takes_its_anchor(tmp_path):
  """Stage 1 on shared storage, the reference and Stage 2's outputs copied to other paths."""
  home, cluster, shared = tmp_path / "home", tmp_path / "cluster", tmp_path / "shared"
  make_checkpoint(str(home / "ref"), 0)
  samples = [[{"token_ids": [7, 8], "text": "ab", "logp_ref": -2.0 - j - i, "logp_proposal": -2.5,
               "reward": float(j % 2), "num_tokens": 2} for j in range(3)] for i in range(6)]
  shared.mkdir()
  s1_path, _ = write_stage1_run(shared, str(home / "ref"), samples)
  claim_output(shared / "s1" / "stage1_identity.json",  # what Stage 1 records of its reference
               identity.inputs(reference_path=str(home / "ref")), overwrite=False,
               has_output=False, discard=lambda: None)
  first = run_stage2(_stage2(home, s1_path))
  assert first.embedding.model_sha256 == fingerprint(home / "ref")
  _move(home, cluster)
  again = run_stage2(_stage2(cluster, s1_path))  # no refit: the stored anchor, found here
  assert again.resumed and again.anchor_path == cluster / "anchor"
  s3 = _stage3(cluster, str(shared / "prompts.jsonl"))
  hidden = load_config(s3.model.reference).hidden_size
  assert isinstance(load_anchor(s3, hidden), Anchor)
  ids, rendering = stage1_lib.encode_stage1_prompts(  # Stage 1's reference, by content
      s1_path, str(cluster / "ref"), load_stage1(s1_path))
  assert len(ids) == 6 and rendering == "plain"
  weights = cluster / "ref" / "model.safetensors"
  data = weights.read_bytes()
  weights.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # fine-tuned: another model, same path
  with pytest.raises(IdentityMismatchError, match="reference_path.sha256"):
    run_stage2(_stage2(cluster, s1_path))
  with pytest.raises(ValueError, match=r"data.anchor_path=.*holds other content"):
    load_anchor(s3, hidden)
  with pytest.raises(ValueError, match="differs from the reference Stage 1 scored the labels"):
    stage1_lib.encode_stage1_prompts(s1_path, str(cluster / "ref"), load_stage1(s1_path))


def _trainer(workdir: Path, ident: dict):
  model = lambda: testing.make_tiny_model(seed=0, **tt.TINY)
  return build_trainer(tt._cfg("grpo", steps=1), str(workdir),
                       tt.StepModels(model(), model(), tt._mesh1(), pad_to=16),
                       tt._task(validation_prompts=tt._prompts(2)),
                       tt.EngineLink(tt.RecordingEngine(model())), identity=ident)


def test_a_checkpoint_that_named_its_input_paths_resumes(tmp_path):
  """Stage 3's checkpoints recorded the input paths in their identity (``model.policy_path``,
  ...); the run now records the rest (identity.json compares the inputs by content)."""
  before = {"model.policy_path": "/home/me/models/qwen3", "data.train_path": "/home/me/train",
            "data.reward": "math", "data.rendering": "chat_template"}
  trainer = _trainer(tmp_path, before)
  trainer.save(1)
  trainer.close()
  now = {"data.reward": "math", "data.rendering": "chat_template"}
  resumed = _trainer(tmp_path, now)
  assert resumed.start_step == 1
  resumed.close()
  with pytest.raises(ValueError, match=r"data.reward='math', this run has 'code'"):
    _trainer(tmp_path, {**now, "data.reward": "code"})


def test_an_evaluation_copied_with_its_models_resumes_and_another_reference_is_refused(tmp_path):
  """The exact measures' pi_ref is an input of each benchmark's identity, compared by content: a
  sum-job workdir copied elsewhere (claims on a copy of claims_quick's) resumes its evaluations."""
  from disa_jax.eval.exact import ExactTargetConfig
  from disa_jax.workflows import evaluation

  def claim(root, wrong_samples=0):
    cfg = evaluation.EvalConfig(
        output_dir=str(root / "eval"), model_path=str(root / "policy"),
        benchmarks={"task": str(root / "task.jsonl")},
        exact_target=ExactTargetConfig(reference_path=str(root / "reference"),
                                       wrong_samples=wrong_samples))
    return evaluation._claim_benchmarks(cfg, cfg.model_path, root / "eval")

  home, moved = tmp_path / "home", tmp_path / "moved"
  _model(home / "policy", b"policy")
  _model(home / "reference", b"reference")
  (home / "task.jsonl").write_text('{"prompt": "p"}\n')
  assert set(claim(home)) == {"task"}
  (home / "eval" / "task.json").write_text("{}")  # its result
  assert claim(home) == {}
  stored = json.loads((home / "eval" / "task.identity.json").read_text())
  # exact_target.wrong_samples, added since, is recorded only where set (as files before it read)
  assert "wrong_samples" not in stored["exact_target"]
  with pytest.raises(IdentityMismatchError) as e:
    claim(home, wrong_samples=8)  # other measures: refused
  assert set(e.value.diffs) == {"exact_target"}
  # an identity file written before pi_ref was fingerprinted resumes at the same place
  (home / "eval" / "task.identity.json").write_text(json.dumps(
      {k: v for k, v in stored.items() if not k.startswith(("exact_reference", "exact_heldout"))}))
  assert claim(home) == {}
  _move(home, moved)
  assert claim(moved) == {}
  (moved / "reference" / "model.safetensors").write_bytes(b"another")
  with pytest.raises(IdentityMismatchError) as e:
    claim(moved)
  assert set(e.value.diffs) == {"exact_reference_path.sha256"}


def test_a_stage3_run_takes_its_held_out_prompts_by_content(tmp_path):
  """The exact measures' held-out prompts (and pi_ref) are inputs of a Stage 3 run's identity: a run
  copied with them resumes, other prompts in the same file are refused, and an identity file written
  before they were fingerprinted resumes where it names them at the same place."""
  from disa_jax.eval.exact import ExactTargetConfig

  def claim(root):
    c = stage3_paper.get_config("grpo,qwen3-4b-base,math")
    c.workdir, c.model.policy_path = str(root / "run"), str(root / "ref")
    c.data.train_path, c.data.validation_paths = str(root / "train.jsonl"), ()
    cfg = Stage3Config.from_config(c)
    cfg = dataclasses.replace(cfg, exact_target=ExactTargetConfig(
        reference_path=str(root / "ref"), heldout_path=str(root / "held.jsonl")))
    return claim_stage3_output(cfg)

  home, moved = tmp_path / "home", tmp_path / "moved"
  _model(home / "ref", b"reference")
  (home / "train.jsonl").write_text('{"prompt": "1+2"}\n')
  (home / "held.jsonl").write_text('{"prompt": "3+4"}\n')
  assert claim(home) == "new"
  (home / "run" / "checkpoints").mkdir()  # its outputs
  assert claim(home) == "resumed"
  path = home / "run" / "identity.json"
  stored = json.loads(path.read_text())
  assert "wrong_samples" not in stored["exact_target"]  # (added since: recorded only where set)
  path.write_text(json.dumps({k: v for k, v in stored.items() if not k.startswith("exact_")
                              or k == "exact_target"}))
  assert claim(home) == "resumed" and json.loads(path.read_text()) == stored
  _move(home, moved)
  assert claim(moved) == "resumed"
  (moved / "held.jsonl").write_text('{"prompt": "5+6"}\n')
  with pytest.raises(IdentityMismatchError) as e:
    claim(moved)
  assert set(e.value.diffs) == {"exact_heldout_path.sha256"}
