"""`SumJob.conditional_kls`: the preference among correct answers per row, cached per checkpoint
(a row added later, or a checkpoint saved again, is computed; an unchanged one is reused), and the
`ConditionalKLs` artifact's file and checks."""
import json
import shutil

import numpy as np
import pytest

from configs import main as main_config
from disa_jax import artifacts
from disa_jax.pipeline.conditional_kls import ConditionalKL, ConditionalKLs, model_identity
from disa_jax.pipeline.job_config import MainConfig
from disa_jax.pipeline.sum_job import SumJob


def _job(tmp_path, **heldout):
  c = main_config.get_config()
  c.task.n_max = 5
  c.reference_model.steps = 2
  c.proposal_model.steps = 2
  c.arch.hidden_size = 32
  c.arch.intermediate_size = 64
  c.arch.num_layers = 1
  c.heldout.update(heldout)
  job = SumJob(MainConfig.from_config(c), tmp_path, progress=False)
  job.build_models()
  return job


@pytest.fixture(scope="module")
def job(tmp_path_factory):
  """A job whose directory holds pi_ref, p_T and the prompt files (no stage run)."""
  return _job(tmp_path_factory.mktemp("ckl"))


def _counting(job, monkeypatch):
  """Records the checkpoints `_correct_set_logprobs` scores."""
  scored, real = [], job._correct_set_logprobs  # pylint: disable=protected-access
  monkeypatch.setattr(job, "_correct_set_logprobs", lambda p: scored.append(p) or real(p))
  return scored


@pytest.mark.slow
def test_a_row_added_later_is_computed_and_the_others_reused(job, tmp_path, monkeypatch):
  a = str(shutil.copytree(job.ref_path, tmp_path / "a"))
  first = job.conditional_kls({"a": a})
  assert list(first.rows) == ["a"]
  np.testing.assert_allclose(first.rows["a"].kl_target, 0.0, atol=1e-9)  # a is pi_ref
  scored = _counting(job, monkeypatch)
  both = job.conditional_kls({"a": a, "b": job.proposal_path})
  assert list(both.rows) == ["a", "b"]  # today's bug: the cached {a} was returned as it was
  assert scored == [job.ref_path, job.proposal_path, job.proposal_path]  # b only, not a again
  np.testing.assert_array_equal(both.rows["a"].kl_target, first.rows["a"].kl_target)
  b = both.rows["b"]
  np.testing.assert_allclose(b.kl_proposal, 0.0, atol=1e-9)  # b is p_T
  assert b.kl_target.shape == (len(job.task.ns),) and b.kl_target.max() > 0  # (n = 0: one answer)
  assert b.kl_target_mean == pytest.approx(b.kl_target.mean())
  assert b.kl_target_mean_heldout is None and "kl_target_correct_mean_heldout" not in b.means()
  again = ConditionalKLs.load(job.dir / "conditional_kl.json")
  assert set(again.rows) == {"a", "b"} and artifacts.fields_equal(again.rows["b"], b)
  scored.clear()
  assert list(job.conditional_kls({"b": job.proposal_path}).rows) == ["b"] and scored == []


def test_a_checkpoint_saved_again_is_computed_again(job, tmp_path, monkeypatch):
  a = tmp_path / "a"
  shutil.copytree(job.ref_path, a)
  assert job.conditional_kls({"a": str(a)}).rows["a"].kl_target.max() < 1e-9
  shutil.rmtree(a)
  shutil.copytree(job.proposal_path, a, copy_function=shutil.copyfile)  # new files, same path
  scored = _counting(job, monkeypatch)
  row = job.conditional_kls({"a": str(a)}).rows["a"]
  assert str(a) in scored and row.kl_proposal.max() < 1e-9 and row.kl_target.max() > 0
  assert row.model_identity == model_identity(a)


def test_a_file_of_the_old_format_is_recomputed_with_a_warning(job):
  path = job.dir / "conditional_kl.json"
  path.write_text(json.dumps({"heldout_prompt_ids": [], "a": {"kl_target_correct_mean": 9.0}}))
  with pytest.warns(UserWarning, match="recomputing every conditional KL.*'prompt_ids'"):
    out = job.conditional_kls({"a": job.ref_path})
  assert out.rows["a"].kl_target_mean == pytest.approx(0.0, abs=1e-9)


def test_heldout_means(tmp_path):
  job = _job(tmp_path, fraction=0.4, seed=1)
  out = job.conditional_kls({"p_t": job.proposal_path})
  row, mask = out.rows["p_t"], out.heldout_mask()
  assert 0 < mask.sum() < mask.size and len(out.heldout_prompt_ids) == mask.sum()
  assert row.kl_target_mean == pytest.approx(row.kl_target[~mask].mean())
  assert row.kl_target_mean_heldout == pytest.approx(row.kl_target[mask].mean())
  assert set(row.means()) == {"kl_target_correct_mean", "kl_proposal_correct_mean",
                              "kl_target_correct_mean_heldout", "kl_proposal_correct_mean_heldout"}


def test_bad_rows_name_the_field(tmp_path):
  with pytest.raises(ValueError, match="'m'.*shapes"):
    ConditionalKL("m", "id", [0.1, 0.2], [0.1], [False, False])
  with pytest.raises(ValueError, match="every prompt is held out"):
    ConditionalKL("m", "id", [0.1], [0.1], [True])
  with pytest.raises(ValueError, match=r"heldout_prompt_ids \['z'\]"):
    ConditionalKLs(tmp_path / "c.json", ("x",), ("z",), "r", "p", {})
  path = tmp_path / "c.json"
  path.write_text(json.dumps({"prompt_ids": ["x"], "heldout_prompt_ids": [], "reference_identity":
                              "r", "proposal_identity": "p", "rows": {"m": {"model_path": "m"}}}))
  with pytest.raises(artifacts.ArtifactError,
                     match="c.json: field 'rows.m.model_identity' is missing"):
    ConditionalKLs.load(path)
  with pytest.raises(FileNotFoundError, match="'nowhere' is not a directory"):
    model_identity("nowhere")
