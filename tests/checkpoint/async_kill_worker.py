"""Saves checkpoint 1, starts the asynchronous save of checkpoint 2, then waits to be killed (-9).

Usage: async_kill_worker.py DIRECTORY POINT. It prints "KILL_NOW" at the kill point POINT:

- 'mid_write': checkpoint 2 holds 256 MiB of random float32; announced as soon as `save` returns,
  while the background thread is writing the arrays.
- 'before_rename': everything of checkpoint 2 is written, including orbax's commit-success file,
  and the final rename of its temporary directory to `2` is held (orbax's `async_path.rename` is
  wrapped); announced from inside that rename.
"""
import os
import sys
import threading
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402
from orbax.checkpoint._src.path import async_path  # noqa: E402

from disa_jax.checkpoint import CheckpointManager  # noqa: E402

STATE1 = {"w": np.arange(1000, dtype=np.float32), "b": np.full((3,), 7, np.int32)}


def _hold_final_rename() -> None:
  original = async_path.rename

  async def rename(src, dst):
    if os.path.basename(str(dst)) == "2":  # the step directory: hold it forever
      print("KILL_NOW", flush=True)
      threading.Event().wait()
    return await original(src, dst)

  async_path.rename = rename


def main():
  directory, point = sys.argv[1], sys.argv[2]
  if point not in ("mid_write", "before_rename"):
    raise SystemExit(f"unknown kill point {point!r}")
  mngr = CheckpointManager(directory, max_to_keep=3)
  mngr.save(1, STATE1, {"step": 1, "data_position": 10})
  mngr.wait_until_finished()
  if point == "before_rename":
    _hold_final_rename()
    state2 = {"w": np.ones(1000, np.float32), "b": np.zeros((3,), np.int32)}
  else:
    state2 = {"w": np.random.default_rng(0).random(64 * 2**20, np.float32),
              "b": np.zeros((3,), np.int32)}
  mngr.save(2, state2, {"step": 2, "data_position": 20})
  if point == "mid_write":
    print("KILL_NOW", flush=True)
  time.sleep(600)


if __name__ == "__main__":
  main()
