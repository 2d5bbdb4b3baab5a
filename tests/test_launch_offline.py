"""The offline job (Stage 1 + 2 on the exact-Z tabular problem) runs, resumes, and rejects bad config."""
import json

import pytest

from configs import offline_synthetic
from disa_jax.pipeline.offline_job import OfflineConfig, run


def _cfg():
  c = offline_synthetic.get_config()
  c.problem.prompts = 300
  c.stage1.chunk = 100
  c.stage2.epochs = 30
  c.stage1.n_study_repeats = 8
  return c


def test_runs_resumes_and_reports(tmp_path):
  cfg = OfflineConfig.from_config(_cfg())
  rep = run(cfg, tmp_path)
  assert set(rep.stage1.n_study_mae_vs_exact) == {"2", "4", "8", "16"}
  errs = list(rep.stage1.n_study_mae_vs_exact.values())
  assert errs[0] > errs[-1]  # the Stage 1 error shrinks with N
  assert (tmp_path / "report.md").exists() and json.loads((tmp_path / "report.json").read_text())
  before = (tmp_path / "stage1.jsonl").read_bytes()
  mtime = (tmp_path / "anchor" / "anchor_meta.json").stat().st_mtime
  rep2 = run(cfg, tmp_path)  # resume: nothing recomputed
  assert (tmp_path / "stage1.jsonl").read_bytes() == before
  assert (tmp_path / "anchor" / "anchor_meta.json").stat().st_mtime == mtime
  assert rep2.stage2.sigma_g_heldout_vs_exact == pytest.approx(rep.stage2.sigma_g_heldout_vs_exact)


def test_resume_after_partial_stage1_gives_same_labels(tmp_path):
  cfg = OfflineConfig.from_config(_cfg())
  run(cfg, tmp_path / "full")
  lines = (tmp_path / "full" / "stage1.jsonl").read_text().splitlines(keepends=True)
  (tmp_path / "part").mkdir()
  (tmp_path / "part" / "stage1.jsonl").write_text("".join(lines[:100]) + lines[100][:30])  # killed mid-chunk
  with pytest.warns(UserWarning, match="partial"):
    run(cfg, tmp_path / "part")
  assert (tmp_path / "part" / "stage1.jsonl").read_text() == "".join(lines)


@pytest.mark.parametrize("field,value,match", [
    ("stage1.samples", 0, r"^config\.stage1\.samples must be >= 1, got 0$"),
    ("stage1.reward_transform.kind", "softmax", r"^config\.stage1\.reward_transform: .*kind .*got 'softmax'$"),
    ("stage1.format", "csv", r"^config\.stage1\.format must be one of .*got 'csv'$"),
    ("stage1.n_study", (0, 4), r"^config\.stage1\.n_study values must be >= 1, got \(0, 4\)$"),
    ("problem.beta", -1.0, r"^config\.problem\.beta must be > 0, got -1\.0$"),
    ("stage2.batch_size", 0, r"^config\.stage2: .*batch_size must be >= 1, got 0$"),
    ("stage2.seed", 1, r"^config\.stage2: unknown field\(s\) \['seed'\]"),
])
def test_bad_config_names_the_field_and_value(field, value, match):
  c = _cfg()
  *parents, leaf = field.split(".")
  section = c
  for name in parents:
    section = section[name]
  section[leaf] = value
  with pytest.raises(ValueError, match=match):
    OfflineConfig.from_config(c)
