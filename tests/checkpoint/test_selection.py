"""Checkpoint selection as in the paper: validation at step 0, the best checkpoint kept beside the
last `keep`, and export / evaluation taking the best by default, saying which step and why."""
import dataclasses
import json
import os
import shutil

import numpy as np
import pytest

from disa_jax import codec, models
from disa_jax.checkpoint import CheckpointManager, CheckpointUnreadableError
from disa_jax.checkpoint.selection import Selection, choose_step
from disa_jax.rl.metrics import read_jsonl
from disa_jax.workflows import evaluation
from disa_jax.workflows.evaluation import EvalConfig, resolve_model
from tests.rl import test_trainer as tt

# Validation Mean@4 after each step of the scripted run below: the best, step 1, is not among
# the last checkpoint (keep = 1), and step 3's tie with step 1 does not displace it.
SCORES = {0: 0.25, 1: 0.75, 2: 0.5, 3: 0.75, 4: 0.0}


def test_manager_keeps_the_protected_step_beside_the_last_k(tmp_path):
  state = {"w": np.zeros(3, np.float32)}
  with CheckpointManager(tmp_path / "c", max_to_keep=2, async_save=False) as mngr:
    mngr.save(1, state, {}, force=True)
    mngr.save(2, state, {}, force=True, keep_also=2)
    for s in (3, 4, 5):
      mngr.save(s, state, {}, force=True)  # keep_also=None: step 2 stays protected
    assert mngr.all_steps() == [2, 4, 5]
    mngr.save(6, state, {}, force=True, keep_also=5)
  assert CheckpointManager(tmp_path / "c").all_steps() == [5, 6]


def test_selection_record():
  sel = Selection("eval/mean@8")
  assert sel.best is None and sel.best_step is None
  sel = sel.add(0, 0.2).add(5, 0.4).add(10, 0.4).add(15, 0.1)
  assert sel.best == (5, 0.4)  # the earliest of a tie
  assert Selection.from_json(json.loads(json.dumps(sel.to_json()))) == sel
  rerun = sel.add(10, 0.9)  # a resumed run validates step 10 again: later scores are dropped
  assert rerun.scores == ((0, 0.2), (5, 0.4), (10, 0.9)) and rerun.best_step == 10


@pytest.fixture(scope="module")
def scripted_run(tmp_path_factory):
  """A real Stage 3 trainer run of 4 steps (validation at step 0 and every step, keep = 1) whose
  validation scores are scripted, plus the config.json the Stage 3 command writes."""
  workdir = tmp_path_factory.mktemp("selection") / "run"
  cfg = tt._cfg(steps=4, method="grpo")  # pylint: disable=protected-access
  cfg = dataclasses.replace(
      cfg, validation=dataclasses.replace(cfg.validation, every=1, at_start=True),
      checkpoint=dataclasses.replace(cfg.checkpoint, every=2, keep=1))
  trainer, _ = tt._trainer(cfg, workdir)  # pylint: disable=protected-access
  trainer.parts.collector.validate = lambda items, done: {"eval/mean@4": SCORES[done]}
  trainer.run()
  trainer.close()
  model_dir = str(workdir.parent / "model")
  models.save_pretrained(tt.testing.make_tiny_model(seed=0, **tt.TINY), model_dir)
  (workdir / "config.json").write_text(json.dumps(
      {"model": {"policy_path": model_dir, "param_dtype": "float32"}}))
  return workdir, trainer


def test_validation_runs_at_step_0_and_the_best_is_kept(scripted_run):
  workdir, trainer = scripted_run
  rows = read_jsonl(str(workdir / "metrics.jsonl"))
  assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
  assert [r["eval/mean@4"] for r in rows] == [SCORES[s] for s in range(5)]
  assert trainer.selection.scores == tuple(SCORES.items())
  # keep = 1: the latest (4) and the best (1); 0 was saved as the best at the time, then dropped.
  assert sorted(int(s) for s in os.listdir(workdir / "checkpoints")) == [1, 4]


def test_choose_step(scripted_run):
  workdir, _ = scripted_run
  best = choose_step(workdir)
  assert (best.step, best.which, best.metric, best.value) == (1, "best", "eval/mean@4", 0.75)
  assert "best of 5 validations by eval/mean@4" in best.reason and "step 4" in best.reason
  latest = choose_step(workdir, "latest")
  assert (latest.step, latest.value) == (4, 0.0)
  assert choose_step(workdir, "1").step == 1
  with pytest.raises(FileNotFoundError, match=r"checkpoint step 2 is not under .* \[1, 4\]"):
    choose_step(workdir, "2")
  with pytest.raises(ValueError, match="must be 'best', 'latest' or a checkpoint step number, "
                                       "got 'newest'"):
    choose_step(workdir, "newest")


def test_a_damaged_chosen_step_is_named_not_exported(scripted_run, tmp_path):
  """Issue 65: the step an export or evaluation would read is checked against its checksums."""
  run = tmp_path / "run"
  shutil.copytree(scripted_run[0], run)
  data = max((run / "checkpoints" / "1" / "state").rglob("d/*"), key=lambda p: p.stat().st_size)
  data.write_bytes(data.read_bytes()[:-1])
  with pytest.raises(CheckpointUnreadableError, match=rf"checkpoint step 1 in {run}/checkpoints/1 "
                     r"\(the best of 5 .*\) is damaged: state/.* holds \d+ bytes"):
    choose_step(run)
  assert choose_step(run, "latest").step == 4


def test_evaluation_exports_the_best_checkpoint_and_says_so(scripted_run, tmp_path):
  workdir, trainer = scripted_run
  cfg = EvalConfig(output_dir=str(tmp_path / "ev"), run_dir=str(workdir),
                   benchmarks={"math500": "unused.jsonl"})
  path, choice = resolve_model(cfg)
  assert path == str(tmp_path / "ev" / "policy_step1") and choice.step == 1
  info = json.loads((tmp_path / "ev" / "policy_step1" / "export_info.json").read_text())
  assert info["step"] == 1 and info["checkpoint"]["which"] == "best"
  assert info["checkpoint"]["reason"] == choice.reason
  # The exported weights are checkpoint 1's, not the final policy's.
  exported = models.to_hf_state_dict(models.from_pretrained(path))
  final = models.to_hf_state_dict(trainer.parts.updater.policy)
  assert any(not np.array_equal(exported[k], np.asarray(final[k])) for k in final)
  # The suite summary says which step was evaluated and why.
  summary = evaluation._write_summary(cfg, path, choice, {}, [], tmp_path / "ev")  # pylint: disable=protected-access
  assert summary.checkpoint == choice and summary.to_json()["checkpoint"] == codec.encode(choice)
  assert json.loads((tmp_path / "ev" / "summary.json").read_text())["checkpoint"]["step"] == 1
  assert f"Checkpoint: step 1 of {workdir}: {choice.reason}" in (tmp_path / "ev" / "summary.md").read_text()
  with pytest.raises(ValueError, match="run_checkpoint must be 'best', 'latest' or a checkpoint "
                                       "step number, got 'last'"):
    EvalConfig(output_dir="o", run_dir=str(workdir), benchmarks={"x": "y"}, run_checkpoint="last")
