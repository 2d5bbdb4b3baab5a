"""The N-study command (`launch/nstudy.py`, `disa_jax.workflows.nstudy`) on tiny checkpoints."""
import json
import os
import subprocess
import sys

import jax
import pytest

from configs import nstudy_paper
from disa_jax.estimators import load_stage1
from disa_jax.estimators import nstudy as nstudy_lib
from disa_jax.workflows.nstudy import NStudyConfig, NStudyResult, run_nstudy
from tests.workflows.conftest import write_dapo_parquet
from tests.workflows.test_end_to_end import stage1_config

PROMPTS, SUBSET, POOL = 12, 6, 8
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _config(checkpoints, files, out_dir, **overrides):
  c = nstudy_paper.get_config("qwen3-4b-base,math")
  c.stage1 = stage1_config(checkpoints, files, out_dir / "unused_stage1", "jax", limit=0)
  c.output_dir = str(out_dir)
  c.subset_size, c.pool_size, c.ms, c.repeats = SUBSET, POOL, (2, 4, 8), 16
  c.ks, c.kmeans_iters = (1, 2, 3, 4), 10
  c.embedding.dtype, c.embedding.batch_size, c.embedding.pad_to = "float32", 4, 32
  c.embedding.attention_chunk, c.embedding.mesh.num_devices = 0, 1
  for k, v in overrides.items():
    setattr(c, k, v)
  return NStudyConfig.from_config(c)


@pytest.mark.slow
def test_nstudy_subset_pool_statistics_and_resume(checkpoints, tmp_path):
  files = {"train": write_dapo_parquet(str(tmp_path / "dapo.parquet"), n=PROMPTS)}
  cfg = _config(checkpoints, files, tmp_path / "ns")
  first = run_nstudy(cfg)
  # The subset: SUBSET distinct prompts of the corpus, every cluster represented.
  subset = json.loads((tmp_path / "ns" / "subset.json").read_text())
  assert subset["prompts"] == PROMPTS and len(set(subset["prompt_ids"])) == SUBSET
  assert subset["k"] in cfg.ks and sum(subset["cluster_sizes"]) == PROMPTS
  assert all(s >= 1 for s, c in zip(subset["subset_cluster_sizes"], subset["cluster_sizes"]) if c)
  # The pool: Stage 1 on exactly the subset, POOL samples per prompt.
  data = load_stage1(cfg.pool_config().dataset_path(), "jsonl")
  assert sorted(data.prompt_ids) == sorted(subset["prompt_ids"])
  assert data.mask.shape == (SUBSET, POOL) and first.stage1.run["prompts_done"] == SUBSET
  # The statistics equal the estimator library's on the same pool and seed.
  ref = nstudy_lib.n_study(jax.random.key(cfg.seed + 1), data.log_weights(),
                           data.mask, ms=cfg.ms, repeats=cfg.repeats).summary()
  assert list(first.per_m) == ref and first.k == subset["k"]
  assert [r["M"] for r in first.per_m] == [2, 4, 8]
  v = {r["M"]: r["variance_mean"] for r in first.per_m}
  assert first.variance_reduction_2_to_8 == pytest.approx(1 - v[8] / v[2])
  assert v[8] < v[2]  # more samples, less variance (a pool of 8: M = 8 is the pool itself)
  assert v[8] == pytest.approx(0.0, abs=1e-10)
  assert (tmp_path / "ns" / "nstudy.png").stat().st_size > 0
  # A rerun resumes: no new Stage 1 work, the same statistics.
  again = run_nstudy(cfg)
  assert again.stage1.run["prompts_done"] == 0 and again.per_m == first.per_m
  assert NStudyResult.load(tmp_path / "ns") == again
  # A rerun on different inputs never serves the old results: it stops, naming the field.
  with pytest.raises(ValueError, match="subset_size"):
    run_nstudy(_config(checkpoints, files, tmp_path / "ns", subset_size=5))
  write_dapo_parquet(files["train"], n=PROMPTS + 1)  # same path, new content
  with pytest.raises(ValueError, match="prompts_path.sha256"):
    run_nstudy(cfg)
  # overwrite=True discards the old study and draws the subset from the new file
  again = run_nstudy(_config(checkpoints, files, tmp_path / "ns", overwrite=True))
  assert json.loads((tmp_path / "ns" / "subset.json").read_text())["prompts"] == PROMPTS + 1


def test_config_is_checked_before_any_work(tmp_path):
  c = nstudy_paper.get_config("qwen3-4b-base,math")
  c.output_dir, c.ms = str(tmp_path), (2, 64)
  with pytest.raises(ValueError, match=r"ms must be .* pool_size=32\], got \(2, 64\)"):
    NStudyConfig.from_config(c)
  c.ms, c.ks = (2, 4), (3, 2, 5)
  with pytest.raises(ValueError, match="ks must be >= 3 increasing"):
    NStudyConfig.from_config(c)
  c.ks, c.stage1.beta = (2, 3, 4), 0.0
  with pytest.raises(ValueError, match="config.stage1: beta must be > 0"):
    NStudyConfig.from_config(c)


def test_the_command_checks_the_pool_config_before_any_work(tmp_path):
  """`launch/nstudy.py` goes through the shared launcher: one line naming the field under
  ``stage1``, exit code 2, and nothing written."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  out = subprocess.run(
      [sys.executable, os.path.join(ROOT, "launch", "nstudy.py"),
       "--config=configs/nstudy_paper.py:qwen3-4b-base,math",
       "--config.stage1.prompts_path=/no/such/prompts.parquet",
       f"--config.output_dir={tmp_path / 'ns'}", "--dry_run"],
      env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
  lines = [l for l in out.stderr.splitlines() if l.strip()]
  assert out.returncode == 2 and len(lines) == 1, out.stderr[-3000:]
  assert lines[0].startswith("error: ") and "stage1.prompts_path='/no/such/prompts.parquet'" in lines[0]
  assert not (tmp_path / "ns").exists()
