"""The prompt file pinned across stages (`disa_jax.workflows.pinned_prompts`): answers replaced
after Stage 1 stop Stage 2 and a Stage 3 run that replays Stage 1 (the issue's DISA pos_replay run
exited 0 with replay accuracy 1.0), each with one line naming the file and both fingerprints;
an unchanged file, a copy of it and a subset with the same answers pass."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from disa_jax import launcher
from disa_jax.checkpoint.identity import fingerprint
from disa_jax.tasks.prompts import load_prompts
from disa_jax.workflows.pinned_prompts import ChangedPromptsError, check_stage1_prompts
from disa_jax.workflows.stage1 import claim_stage1_output
from tests.test_dry_run_commands import make_inputs, typed_config
from tests.workflows.conftest import write_dapo_parquet

ROOT = Path(__file__).resolve().parents[2]
S1 = ["--config=configs/stage1_paper.py:qwen3-4b-base,math"]
S2 = ["--config=configs/stage2_paper.py:qwen3-4b-base,math",
      "--config.anchor_path=anchors/fitted_now"]  # (Stage 3's inputs hold an anchor at the default)
S3 = ["--config=configs/stage3_paper.py:disa,qwen3-4b-base,math,variant=pos_replay", "--workdir=run"]


@pytest.fixture()
def stage1(tmp_path, monkeypatch):
  """The inputs of the paper's Stage 1 / 2 / 3 commands in ``tmp_path``, a real prompt file, and
  Stage 1's output identity as Stage 1 records it: (Stage 1 config, its dataset path)."""
  monkeypatch.chdir(tmp_path)
  cfg = typed_config("stage1", S1)
  make_inputs(cfg)
  write_dapo_parquet(cfg.prompts_path, 6)
  claim_stage1_output(cfg)
  for script, argv in (("stage2", S2), ("train", S3)):  # the Stage 1 dataset among them
    make_inputs(typed_config(script, argv))
  return cfg


def _replace_an_answer(path: str) -> None:
  table = pq.read_table(path).to_pylist()
  table[2]["reward_model"]["ground_truth"] = "z"
  pq.write_table(pa.Table.from_pylist(table), path)


def _error_line(script, argv, capfd):
  capfd.readouterr()
  rc = launcher.invoke(str(ROOT / "launch" / f"{script}.py"), argv)
  err = capfd.readouterr().err
  lines = [l for l in err.splitlines() if l.startswith("error: ")]  # (after preflight's notes)
  assert rc == 2 and len(lines) == 1 and err.rstrip().endswith(lines[0]), err[-3000:]
  return lines[0]


@pytest.mark.parametrize("script,argv", [("stage2", S2), ("train", S3)], ids=["stage2", "stage3"])
def test_answers_replaced_after_stage1_are_refused_naming_both_fingerprints(stage1, script, argv,
                                                                            capfd):
  recorded = json.loads((Path(stage1.output_dir) / "stage1_identity.json").read_text())[
      "prompts_path.sha256"]
  _replace_an_answer(stage1.prompts_path)
  line = _error_line(script, argv, capfd)
  assert (f"the prompt file {stage1.prompts_path!r} changed since Stage 1 graded its samples "
          f"(sha256 {recorded} recorded in") in line, line
  assert f", {fingerprint(stage1.prompts_path)} now)" in line and "rerun Stage 1" in line, line


def test_the_same_answers_in_a_copy_or_a_subset_pass_and_a_subset_with_other_answers_does_not(
    stage1, tmp_path):
  dataset = str(stage1.dataset_path())
  check_stage1_prompts(dataset)  # Stage 2: Stage 1's file, unchanged
  copy = str(tmp_path / "copy.parquet")
  shutil.copy(stage1.prompts_path, copy)
  check_stage1_prompts(dataset, field="data.train_path", prompts_path=copy)
  subset = str(tmp_path / "subset.parquet")
  write_dapo_parquet(subset, 4)  # the first 4 rows: ids and answers as in Stage 1's 6
  assert len(load_prompts(subset)) == 4
  check_stage1_prompts(dataset, field="data.train_path", prompts_path=subset)
  _replace_an_answer(subset)
  with pytest.raises(ChangedPromptsError, match=r"data.train_path='.*subset.parquet': 1 prompt\(s\) "
                     r"differ in text or answer from Stage 1's prompt file"):
    check_stage1_prompts(dataset, field="data.train_path", prompts_path=subset)
