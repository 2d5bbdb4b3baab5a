"""An entry module for `launch/multihost.py` that runs one small all-gather over every process
twenty times a second until the file named by ``DISA_TEST_STOP`` exists (or forever): a stand-in
for a training loop whose processes meet in a collective every step. Prints ``ready <pid>`` once
the first collective is done. The process ``DISA_TEST_FAIL_PROCESS`` names raises at step 3."""
import os
import time

import jax
import numpy as np

from disa_jax.parallel import distributed

if __name__ == "__main__":
  stop = os.environ.get("DISA_TEST_STOP", "")
  for step in range(10 ** 9):
    distributed.process_allgather(np.array([step], np.int32))
    if step == 0:
      print("ready", os.getpid(), flush=True)
    if step == 3 and os.environ.get("DISA_TEST_FAIL_PROCESS") == str(jax.process_index()):
      raise RuntimeError("a planned failure")
    if distributed.any_process(bool(stop) and os.path.exists(stop)):  # all stop at one step
      break
    time.sleep(0.05)
  distributed.sync_global("done")
  print("done", flush=True)
