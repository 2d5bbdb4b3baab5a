"""A damaged checkpoint through the command a user types (issue 65): `launch/train.py` rerun on a
workdir whose newest checkpoint step has a truncated array file resumes from the step before, with
one ``warning:`` line naming both steps and no traceback; with every step damaged it stops with one
``error:`` line naming the checkpoint directory. (Each kind of damage to each kind of file, at the
`CheckpointManager` level: tests/checkpoint/test_checkpoint_faults.py.)"""
import subprocess

import pytest

from tests.workflows import test_preemption as tp
from tests.workflows.conftest import worker_env

STEPS = 3


def _cmd(tmp_path, workdir):
  """The tiny Stage 3 run of tests/workflows/test_preemption.py, checkpointed every step, the
  generation in this process, no validation."""
  change = {"--config.train.checkpoint.every": "1", "--config.train.checkpoint.keep": "3",
            "--config.train.total_steps": str(STEPS), "--config.engine.separate_process": "False",
            "--config.train.validation.every": "0"}
  cmd = [a for a in tp._stage3_cmd(tmp_path, workdir)  # pylint: disable=protected-access
         if a.split("=", 1)[0] not in change]
  return cmd + [f"{k}={v}" for k, v in change.items()]


def _array_file(step_dir):
  return max((step_dir / "state" / "ocdbt.process_0" / "d").iterdir(), key=lambda p: p.stat().st_size)


def _truncate(path):
  path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])


@pytest.mark.slow  # three tiny Stage 3 commands (~25 s each on 2 cores)
def test_a_truncated_array_file_resumes_from_the_step_before_in_one_warning_line(tmp_path):
  work = tmp_path / "run"
  first = tp._run(_cmd(tmp_path, work), worker_env())  # pylint: disable=protected-access
  ckpts = work / "checkpoints"
  assert tp._summary(first.stdout)["preempted"] is None  # pylint: disable=protected-access
  steps = sorted(int(p.name) for p in ckpts.iterdir() if p.name.isdigit())
  assert steps[-2:] == [STEPS - 1, STEPS], steps
  _truncate(_array_file(ckpts / str(STEPS)))

  second = subprocess.run(_cmd(tmp_path, work), env=worker_env(), cwd=tp.ROOT, capture_output=True,
                          text=True, timeout=900)
  assert second.returncode == 0 and "Traceback" not in second.stderr, second.stderr[-4000:]
  warned = [l for l in second.stderr.splitlines() if "damaged" in l]
  assert len(warned) == 1 and warned[0].startswith(
      f"warning: checkpoint step {STEPS} in {ckpts} is damaged and skipped"), second.stderr[-4000:]
  assert warned[0].endswith(f"; resuming from step {STEPS - 1}"), warned
  assert tp._summary(second.stdout)["start_step"] == STEPS - 1  # pylint: disable=protected-access

  for p in ckpts.iterdir():
    if p.name.isdigit():
      _truncate(_array_file(p))
  third = subprocess.run(_cmd(tmp_path, work), env=worker_env(), cwd=tp.ROOT, capture_output=True,
                         text=True, timeout=900)
  assert third.returncode == 2 and "Traceback" not in third.stderr, third.stderr[-4000:]
  errors = [l for l in third.stderr.splitlines() if l.startswith("error:")]
  assert len(errors) == 1 and errors[0].startswith(
      f"error: no usable checkpoint in {ckpts}: every step is damaged"), third.stderr[-4000:]
