"""Resumable outputs never lose rows, and a resume never mixes two runs (issue 39).

- A Stage 3 rerun with another ``train.total_steps`` (or any training field that changes what a
  step computes) is refused before any work, naming the fields and ``overwrite``; a workdir whose
  identity.json predates those fields resumes when its checkpoint's config agrees. The `Trainer`
  itself refuses a ``total_steps`` that moves the learning rate's decay phase.
- A damaged middle row of metrics.jsonl never shortens it: the file as found is copied aside, the
  row is named, the intact rows are kept, and the lost rows are computed again from the checkpoint
  before them: the file then equals an uninterrupted run's.
- A full disk names the file being written (Stage 1 parts and jsonl, the metrics).
- SIGTERM while the generation process starts stops Stage 3 cleanly (a summary with
  ``preempted``, no error); the rerun trains the whole run.
"""
import dataclasses
import errno
import json
import os
import shutil
import signal
import warnings
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from configs import stage3_paper
from disa_jax import config as config_lib
from disa_jax import preemption, testing
from disa_jax.checkpoint.files import OutputWriteError
from disa_jax.checkpoint.identity import IdentityMismatchError
from disa_jax.estimators import dataset
from disa_jax.rl import metrics
from disa_jax.rl.trainer import Trainer
from disa_jax.rollout.process import RemoteEngine
from disa_jax.workflows.stage3 import Stage3Config, claim_stage3_output, run_stage3
from tests.rl import test_trainer as tt
from tests.workflows.conftest import tiny_stage3_config


def _damage(path, line, at=5):
  """Puts a NUL byte into line ``line`` (1-based) of ``path``; returns the damaged bytes."""
  lines = Path(path).read_bytes().splitlines(keepends=True)
  lines[line - 1] = lines[line - 1][:at] + b"\x00" + lines[line - 1][at + 1:]
  Path(path).write_bytes(b"".join(lines))
  return b"".join(lines)


# -- identity: total_steps and the other training fields -----------------------------------------


def _stage3_config(tmp_path):
  policy = tmp_path / "policy"
  policy.mkdir(exist_ok=True)
  (policy / "model.safetensors").write_bytes(b"weights")
  (tmp_path / "train.jsonl").write_text('{"prompt": "p"}\n')
  c = stage3_paper.get_config("grpo,qwen3-4b-base,math")
  c.workdir, c.model.policy_path = str(tmp_path / "run"), str(policy)
  c.data.train_path, c.data.validation_paths = str(tmp_path / "train.jsonl"), ()
  c.train.total_steps = 3
  return Stage3Config.from_config(c)


def _fake_checkpoint(cfg, step, drop=()):
  """A finished checkpoint directory whose meta records ``cfg.train`` (less the ``drop`` sections,
  as a checkpoint written before they existed)."""
  ckpt = Path(cfg.workdir, "checkpoints", str(step))
  (ckpt / "state").mkdir(parents=True)
  (ckpt / "meta").mkdir()
  train = {k: v for k, v in config_lib.to_dict(cfg.train).items() if k not in drop}
  (ckpt / "meta" / "metadata").write_text(json.dumps({"rl_step": step, "config": train}))


def _strip_train_fields(cfg):
  """identity.json as a run before this change wrote it (no train.* fields)."""
  path = Path(cfg.workdir, "identity.json")
  ident = json.loads(path.read_text())
  path.write_text(json.dumps({k: v for k, v in ident.items() if not k.startswith("train.")}))


def test_stage3_rerun_with_other_total_steps_is_refused_naming_the_fields(tmp_path):
  cfg = _stage3_config(tmp_path)
  assert claim_stage3_output(cfg) == "new"
  _fake_checkpoint(cfg, 3)  # the finished 3-step run
  assert claim_stage3_output(cfg) == "resumed"
  longer = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, total_steps=6))
  with pytest.raises(IdentityMismatchError) as e:
    run_stage3(longer)  # refused before anything loads
  assert set(e.value.diffs) == {"train.total_steps"}
  assert "train.total_steps: stored 3, this run 6" in str(e.value)
  assert "overwrite=True" in str(e.value)
  optim = dataclasses.replace(cfg.train.optim, lr=cfg.train.optim.lr * 2, decay_frac=0.1)
  with pytest.raises(IdentityMismatchError) as e:
    claim_stage3_output(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, optim=optim)))
  assert set(e.value.diffs) == {"train.optim.lr", "train.optim.decay_frac"}
  log_more = dataclasses.replace(cfg.train, log_every=3, progress_bar=False)  # not computed
  assert claim_stage3_output(dataclasses.replace(cfg, train=log_more)) == "resumed"
  assert claim_stage3_output(dataclasses.replace(longer, overwrite=True)) == "overwritten"
  assert not os.path.exists(os.path.join(cfg.workdir, "checkpoints"))


def test_an_identity_file_written_before_the_training_fields_still_resumes(tmp_path):
  cfg = _stage3_config(tmp_path)
  assert claim_stage3_output(cfg) == "new"
  _fake_checkpoint(cfg, 2, drop=("replay",))  # a checkpoint older than the replay section too
  _strip_train_fields(cfg)
  assert claim_stage3_output(cfg) == "resumed"  # the checkpoint's config agrees
  stored = json.loads(Path(cfg.workdir, "identity.json").read_text())
  assert stored["train.total_steps"] == 3 and stored["train.replay.fraction"] == 0.0
  _strip_train_fields(cfg)
  longer = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, total_steps=6))
  with pytest.raises(IdentityMismatchError) as e:
    claim_stage3_output(longer)
  assert e.value.diffs == {"train.total_steps": (3, 6)}  # the stored value: the checkpoint's


# -- metrics.jsonl: a damaged row never shortens the file ----------------------------------------


def test_a_damaged_middle_row_is_set_aside_named_and_never_shortens_the_file(tmp_path):
  with metrics.MetricsLogger(str(tmp_path), tensorboard=False) as log:
    for step in range(1, 7):
      log.write(step, {"loss": float(step)})
  path = str(tmp_path / "metrics.jsonl")
  damaged = _damage(path, 3)
  with pytest.warns(RuntimeWarning, match=r"metrics.jsonl: 1 damaged line\(s\) \(line 3: "):
    metrics.MetricsLogger(str(tmp_path), resume_step=6, tensorboard=False).close()
  assert [r["step"] for r in metrics.read_jsonl(path)] == [1, 2, 4, 5, 6]
  assert (tmp_path / "metrics.jsonl.damaged-1").read_bytes() == damaged
  _damage(path, 3)  # (now the row of step 4)
  scan = metrics.scan_jsonl(path)
  assert [n for n, _ in scan.damaged] == [3] and scan.first_lost_step() == 3
  with pytest.warns(RuntimeWarning, match=r"\(line 3: .*damaged-2; its intact rows up to step 5"):
    metrics.MetricsLogger(str(tmp_path), resume_step=5, tensorboard=False).close()
  assert [r["step"] for r in metrics.read_jsonl(path)] == [1, 2, 5]
  with open(path, "a") as f:
    f.write('{"step": 6, "lo')  # a torn last line: a killed write, not damage
  scan = metrics.scan_jsonl(path)
  assert scan.torn and not scan.damaged and scan.first_lost_step() is None
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    metrics.MetricsLogger(str(tmp_path), resume_step=5, tensorboard=False).close()
  assert [r["step"] for r in metrics.read_jsonl(path)] == [1, 2, 5]
  assert not (tmp_path / "metrics.jsonl.damaged-3").exists()


def _decaying_cfg(steps):
  """The tiny DISA run of tests/rl/test_trainer.py, its learning rate decaying over the last half,
  every checkpoint kept, no validation (fewer programs to compile)."""
  cfg = tt._cfg(steps=steps)  # pylint: disable=protected-access
  return dataclasses.replace(
      cfg, optim=dataclasses.replace(cfg.optim, decay_frac=0.5),
      checkpoint=dataclasses.replace(cfg.checkpoint, keep=steps, async_save=False),
      validation=dataclasses.replace(cfg.validation, every=0), tensorboard=False)


@pytest.mark.slow  # a 3-step tiny DISA run and 2 recomputed steps: ~25 s of CPU, compile-bound
def test_lost_rows_are_computed_again_from_the_checkpoint_before_them(tmp_path):
  cfg = _decaying_cfg(3)
  ref, _ = tt._trainer(cfg, tmp_path / "ref")  # pylint: disable=protected-access
  ref.run()
  ref.close()
  strip = tt._strip_time  # pylint: disable=protected-access
  want = strip(metrics.read_jsonl(str(tmp_path / "ref" / "metrics.jsonl")))
  assert [r["step"] for r in want] == [1, 2, 3]
  # The runs below resume on the reference run's parts (its compiled programs; each resume loads
  # its checkpoint's state into them).
  resume = lambda c, name: Trainer(c, str(tmp_path / name), ref.parts)

  shutil.copytree(tmp_path / "ref", tmp_path / "gap")  # no checkpoint before the damage is left
  shutil.rmtree(tmp_path / "gap" / "checkpoints" / "1")
  _damage(str(tmp_path / "gap" / "metrics.jsonl"), 2)
  with pytest.warns(RuntimeWarning) as caught:
    gap = resume(cfg, "gap")
  said = " | ".join(str(w.message) for w in caught)
  assert "(line 2: JSONDecodeError" in said and "no checkpoint before step 2 is left" in said
  assert gap.start_step == 3
  gap.close()
  assert [r["step"] for r in metrics.read_jsonl(str(tmp_path / "gap" / "metrics.jsonl"))] == [1, 3]

  shutil.copytree(tmp_path / "ref", tmp_path / "run")
  damaged = _damage(str(tmp_path / "run" / "metrics.jsonl"), 2)
  with pytest.warns(RuntimeWarning) as caught:
    again = resume(cfg, "run")
  said = " | ".join(str(w.message) for w in caught)
  assert "(line 2: JSONDecodeError" in said and "intact rows up to step 1 are kept" in said
  assert "resuming from checkpoint 1 to compute steps 2-3 again (checkpoints [2, 3] deleted" in said
  assert again.start_step == 1
  again.run()
  again.close()
  assert strip(metrics.read_jsonl(str(tmp_path / "run" / "metrics.jsonl"))) == want
  assert (tmp_path / "run" / "metrics.jsonl.damaged-1").read_bytes() == damaged
  assert sorted(os.listdir(tmp_path / "run" / "checkpoints")) == ["1", "2", "3"]

  with pytest.raises(ValueError, match=r"total_steps=3, this run has 4: with optim.decay_frac=0.5 "
                                       r"the learning rate's decay phase starts at optimizer "
                                       r"update 3 there and 4 here"):
    resume(_decaying_cfg(4), "run")


# -- a full disk names the file ------------------------------------------------------------------


def _record(pid):
  return {"prompt_id": pid, "prompt": "p", "samples": [
      {"token_ids": [1], "text": "a", "logp_ref": -1.0, "logp_proposal": -1.0, "reward": 1.0,
       "num_tokens": 1}], "beta": 1.0, "reward_transform": {"kind": "raw"}, "label_scale": "sum",
          "proposal_logprobs": "processed"}


def _disk_full(*args, **kwargs):
  raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_full_disk_names_the_stage1_part_and_loses_nothing(tmp_path, monkeypatch):
  out = tmp_path / "stage1"
  with dataset.Stage1Writer(out, "parquet") as w:
    w.write([_record("a")])
    monkeypatch.setattr(pq, "write_table", _disk_full)
    with pytest.raises(OutputWriteError) as e:
      w.write([_record("b")])
    assert e.value.errno == errno.ENOSPC and isinstance(e.value, OSError)
    assert str(out / "part-000001.parquet.tmp") in str(e.value)
    assert "No space left on device (writing a Stage 1 dataset part)" in str(e.value)
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == [
        "part-000000.parquet"]
    monkeypatch.undo()
    w.write([_record("b")])
  assert dataset.load_stage1(out).prompt_ids == ["a", "b"]

  jsonl = tmp_path / "s1.jsonl"
  with dataset.Stage1Writer(jsonl) as w:
    monkeypatch.setattr(os, "fsync", _disk_full)
    with pytest.raises(OutputWriteError, match=rf"No space left on device \(writing the Stage 1 "
                                               rf"dataset\): '{jsonl}'"):
      w.write([_record("c")])
    monkeypatch.undo()


def test_a_full_disk_names_the_metrics_file(tmp_path, monkeypatch):
  log = metrics.MetricsLogger(str(tmp_path), tensorboard=False)
  monkeypatch.setattr(os, "fsync", _disk_full)
  with pytest.raises(OutputWriteError, match=rf"\[Errno 28\] No space left on device \(writing the "
                                             rf"run's metrics\): '{tmp_path / 'metrics.jsonl'}'"):
    log.write(1, {"loss": 1.0})
  monkeypatch.undo()
  log.close()


# -- SIGTERM while the generation process starts -------------------------------------------------


def _signal_while_starting(monkeypatch):
  """SIGTERM to the generation process as soon as it exists (its interpreter still starting) and to
  this process, as SLURM signals every process of a job step."""
  wait = RemoteEngine._wait_startup  # pylint: disable=protected-access

  def signalled(self, timeout):
    os.kill(self.pid, signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGTERM)
    return wait(self, timeout)

  monkeypatch.setattr(RemoteEngine, "_wait_startup", signalled)


def test_the_generation_process_survives_sigterm_while_it_starts(tmp_path, monkeypatch):
  ckpt = testing.save_tiny_checkpoint(str(tmp_path / "model"))
  _signal_while_starting(monkeypatch)
  with preemption.watch():
    with RemoteEngine("jax", ckpt) as engine:
      assert engine.ping() == engine.pid
    assert preemption.requested() == "SIGTERM"


@pytest.mark.slow  # two tiny Stage 3 runs, each starting a generation process (~40 s on 2 cores)
def test_stage3_sigterm_during_startup_stops_cleanly_and_the_rerun_trains(tmp_path, monkeypatch):
  cfg = Stage3Config.from_config(tiny_stage3_config(tmp_path, separate_process=True, steps=2))
  _signal_while_starting(monkeypatch)
  first = run_stage3(cfg)
  assert (first.preempted, first.steps_run, first.export) == (0, 0, None)
  monkeypatch.undo()
  second = run_stage3(cfg)
  assert second.preempted is None and second.start_step == 0 and second.steps_run == 2
  assert second.export is not None and second.export_checkpoint.step == 2
