"""Checkpoint faults at the `CheckpointManager` level: a full disk during a save, kill -9 while an
asynchronous save is being written, and a finished step damaged afterwards (each file kind
truncated, deleted, a byte flipped). Either way the previous checkpoint is the one a restore uses,
and the run can save again. (Through the command: tests/checkpoint/test_damaged_resume.py.)

The full disk is a real one: a 1 MiB tmpfs mounted for the test (needs root and mount(8)).
"""
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from disa_jax.checkpoint import CheckpointManager, CheckpointSaveError, CheckpointUnreadableError

ROOT = pathlib.Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "checkpoint" / "async_kill_worker.py"
SMALL = {"w": np.arange(1000, dtype=np.float32), "b": np.full((3,), 7, np.int32)}


def _big(seed):
  """~2.4 MB of incompressible float32: more than the 1 MiB disk."""
  return {"w": np.random.default_rng(seed).random(600_000, np.float32),
          "b": np.zeros((3,), np.int32)}


def _target(state):
  return {k: np.zeros_like(v) for k, v in state.items()}


def _assert_restores_step1(directory):
  mngr = CheckpointManager(directory)  # a new manager, as a resumed run makes
  assert mngr.latest_step() == 1 and mngr.all_steps() == [1]
  step, state, meta = mngr.restore(_target(SMALL))
  assert step == 1 and meta["step"] == 1
  for k in SMALL:
    np.testing.assert_array_equal(state[k], SMALL[k])
  return mngr


def _no_partial_saves(directory):
  """No temporary directory is left (orbax removes them in the background; done by a save)."""
  return [p for p in os.listdir(directory) if "tmp" in p] == []


@pytest.fixture()
def full_disk(tmp_path):
  """A mounted 1 MiB tmpfs (unmounted after the test)."""
  mnt = tmp_path / "tiny_fs"
  mnt.mkdir()
  if os.geteuid() != 0 or shutil.which("mount") is None:
    pytest.skip("a full disk needs a tmpfs mount: run as root with mount(8)")
  out = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
  if out.returncode != 0:
    pytest.skip(f"cannot mount a tmpfs here: {out.stderr.strip()}")
  try:
    yield mnt
  finally:  # (orbax may still be removing a partial save in the background: busy for a moment)
    for _ in range(20):
      if subprocess.run(["umount", str(mnt)], capture_output=True).returncode == 0:
        break
      time.sleep(0.25)
    else:
      subprocess.run(["umount", "-l", str(mnt)], check=True)  # detached once no longer busy


@pytest.mark.parametrize("async_save", [True, False])
def test_disk_full_during_a_save(full_disk, async_save):
  directory = str(full_disk / "ckpt")
  mngr = CheckpointManager(directory, max_to_keep=3, async_save=async_save)
  mngr.save(1, SMALL, {"step": 1})
  mngr.wait_until_finished()
  regex = (rf"checkpoint step 2 could not be written under {directory}: the disk is full \(ENOSPC: "
           r"no space left on device\); free space or choose another checkpoint directory\. The "
           r"finished checkpoints are intact; the latest is step 1\. Cause: .*No space left on "
           r"device")
  with pytest.raises(CheckpointSaveError, match=regex) as err:
    mngr.save(2, _big(0), {"step": 2})
    mngr.wait_until_finished()  # an asynchronous save fails here
  assert err.value.step == 2 and err.value.latest_step == 1 and err.value.disk_full
  mngr.close()
  mngr = _assert_restores_step1(directory)
  mngr.save(2, SMALL, {"step": 2})  # the space of the partial save was freed: saving works again
  mngr.close()
  assert CheckpointManager(directory).all_steps() == [1, 2] and _no_partial_saves(directory)


def test_disk_full_surfaces_at_the_next_save(full_disk):
  """An asynchronous failure not waited for is reported by the next `save`, naming its own step."""
  directory = str(full_disk / "ckpt")
  mngr = CheckpointManager(directory, max_to_keep=3)
  mngr.save(1, SMALL, {"step": 1})
  mngr.wait_until_finished()
  mngr.save(2, _big(1), {"step": 2})
  with pytest.raises(CheckpointSaveError, match=r"checkpoint step 2 could not be written .* the "
                                                r"latest is step 1"):
    mngr.save(3, SMALL, {"step": 3})
  mngr.close()
  _assert_restores_step1(directory).close()


@pytest.mark.parametrize("point", ["mid_write", "before_rename"])
def test_kill9_during_an_async_save_keeps_the_previous_checkpoint(tmp_path, point):
  directory = tmp_path / "ckpt"
  env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", XLA_FLAGS="")
  proc = subprocess.Popen([sys.executable, str(WORKER), str(directory), point], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  lines = []
  try:
    deadline = time.time() + 300
    for line in proc.stdout:
      lines.append(line)
      if line.strip() == "KILL_NOW" or time.time() > deadline:
        break
    assert lines and lines[-1].strip() == "KILL_NOW", "".join(lines)[-3000:]
    os.kill(proc.pid, signal.SIGKILL)
  finally:
    proc.kill()
    proc.wait(timeout=30)
  assert proc.returncode == -signal.SIGKILL
  names = sorted(os.listdir(directory))
  assert "1" in names and "2" not in names, names  # killed before checkpoint 2 was finished
  assert any(n.startswith("2.orbax-checkpoint-tmp") for n in names), names  # ... while writing it
  mngr = _assert_restores_step1(str(directory))
  assert mngr.restore(_target(SMALL))[2] == {"step": 1, "data_position": 10}
  mngr.save(2, SMALL, {"step": 2, "data_position": 20})  # the resumed run saves step 2 again
  mngr.close()
  assert CheckpointManager(directory).latest_step() == 2 and _no_partial_saves(directory)


def test_save_interval_and_force(tmp_path):
  with CheckpointManager(tmp_path / "c", save_interval_steps=2) as mngr:
    assert mngr.save(2, SMALL, {"step": 2}) is True
    assert mngr.save(3, SMALL, {"step": 3}) is False  # not a multiple of 2: nothing written
    assert mngr.save(4, SMALL, {"step": 4}) is True
    assert mngr.save(5, SMALL, {"step": 5}, force=True) is True
  assert CheckpointManager(tmp_path / "c").all_steps() == [2, 4, 5]


def _files_of_each_kind(step_dir):
  """One file of each kind a step holds: array data, the array metadata, OCDBT's manifest, the JSON
  meta, the checksums."""
  data = max((step_dir / "state" / "ocdbt.process_0" / "d").iterdir(), key=lambda p: p.stat().st_size)
  return {"array_data": data, "array_metadata": step_dir / "state" / "_METADATA",
          "ocdbt_manifest": step_dir / "state" / "ocdbt.process_0" / "manifest.ocdbt",
          "meta": step_dir / "meta" / "metadata", "checksums": step_dir / "checksums.json"}


def _damage(path, how):
  data = path.read_bytes()
  if how == "truncate":
    path.write_bytes(data[:len(data) // 2])
  elif how == "delete":
    path.unlink()
  else:  # one byte flipped in the middle: same size
    i = len(data) // 2
    path.write_bytes(data[:i] + bytes([data[i] ^ 0x40]) + data[i + 1:])


@pytest.mark.parametrize("async_save", [True, False])
def test_each_kind_of_damage_to_each_kind_of_file_skips_the_step_in_one_warning(tmp_path, async_save):
  """Issue 65: a step is used only if its files match the checksums recorded at save; a damaged
  newest step is skipped with one warning naming it and the step resumed from, the restore gives
  the previous step's arrays, and the resumed run writes the step again. (A lost checksums.json
  leaves the step usable: its arrays still read.)"""
  base = tmp_path / "base"
  with CheckpointManager(base, async_save=async_save) as mngr:
    for step in (1, 2, 3):
      mngr.save(step, {k: v + step for k, v in SMALL.items()}, {"step": step})
  for kind in _files_of_each_kind(base / "3"):
    for how in ("truncate", "delete", "flip"):
      directory = tmp_path / f"{kind}_{how}"
      shutil.copytree(base, directory)
      _damage(_files_of_each_kind(directory / "3")[kind], how)
      mngr = CheckpointManager(directory, async_save=False)
      if kind == "checksums" and how == "delete":
        assert mngr.latest_step() == 3
        mngr.close()
        continue
      with pytest.warns(RuntimeWarning) as caught:
        assert mngr.latest_step() == 2, (kind, how)
      [w] = caught
      assert re.fullmatch(rf"checkpoint step 3 in {directory} is damaged and skipped \(step 3: "
                          r"[^\n]+\); resuming from step 2", str(w.message)), str(w.message)
      step, state, meta = mngr.restore(_target(SMALL))
      assert step == 2 and meta == {"step": 2}
      np.testing.assert_array_equal(state["w"], SMALL["w"] + 2)
      assert mngr.save(3, SMALL, {"step": 3})  # the resumed run writes step 3 again
      mngr.close()
      assert CheckpointManager(directory).latest_step() == 3


def test_no_usable_step_is_an_error_naming_the_directory(tmp_path):
  directory = tmp_path / "ckpt"
  with CheckpointManager(directory, async_save=False) as mngr:
    for step in (1, 2):
      mngr.save(step, SMALL, {"step": step})
  for step in (1, 2):
    _damage(_files_of_each_kind(directory / str(step))["array_data"], "flip")
  with pytest.raises(CheckpointUnreadableError, match=rf"no usable checkpoint in {directory}: "
                     r"every step is damaged \(step 1: .*CRC-32.*; step 2: "):
    CheckpointManager(directory).latest_step()
