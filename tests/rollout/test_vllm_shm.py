"""Issue 24 finding 11: vLLM's generation process leaves nothing in /dev/shm, whether it is closed
or killed with SIGKILL (and a new one started).

vLLM's processes create ``psm_*`` segments and ``sem.mp-*`` semaphores through Python's
`multiprocessing`; the generation process has a resource tracker of its own
(`reaper.use_private_resource_tracker`), which outlives a kill -9 and removes them. The test
records every /dev/shm name the worker's process tree maps (``/proc/<pid>/maps``) and checks that
none of them is left once the worker has ended; the project's own ``disa_ro_*`` segments are
checked as before (`shm.list_segments`). Comparing all of /dev/shm before and after would also
see other processes' segments (tests running beside this one), so only the tree's names count.
Without the private tracker the killed worker's semaphore stays until this process exits.
"""
import os
import time

import pytest

from disa_jax.rollout import GenerationProcessError, ProcessOptions, SamplingParams, make_engine
from disa_jax.rollout import reaper, shm

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PARAMS = SamplingParams(n=2, temperature=1.0, max_tokens=8, stop_token_ids=(2,))


def _start(ckpt):
  engine = make_engine("vllm", ckpt, options=dict(max_model_len=128, max_num_seqs=8),
                       process=ProcessOptions(startup_timeout_s=600))
  engine.generate([[1, 5, 6]], PARAMS)
  names = {n for n in reaper.mapped_shm_names(reaper.process_tree(engine.pid))
           if not n.startswith(shm.PREFIX)}
  assert names, "vLLM's process tree maps no /dev/shm name: the test would check nothing"
  return engine, names


def _left(names, timeout_s=20.0):
  """The names still in /dev/shm after waiting up to ``timeout_s`` for them to go."""
  deadline = time.monotonic() + timeout_s
  while True:
    left = sorted(n for n in names if os.path.exists(os.path.join(reaper.SHM_DIR, n)))
    if not left or time.monotonic() > deadline:
      return left
    time.sleep(0.2)


def test_vllm_generation_process_leaves_nothing_in_dev_shm(tiny_ckpt):
  killed, killed_names = _start(tiny_ckpt)
  os.kill(killed.pid, 9)
  with pytest.raises(GenerationProcessError):
    killed.generate([[1, 5, 6]], PARAMS)
  restarted, names = _start(tiny_ckpt)  # the restart, as a trainer would do
  assert _left(killed_names) == [], f"left by the killed worker: {killed_names}"
  restarted.close()
  assert _left(names) == [], f"left by the closed worker: {names}"
  assert shm.list_segments(os.getpid()) == []
