"""`disa_jax.preemption`'s stop-with-parent: a pool worker whose parent died stops its stage as on
SIGTERM, then exits, instead of training on as an orphan (a killed main job once left its two Stage 3 workers
training for 55 minutes), and then takes no queued stage (a killed job's orphaned workers once saved
their runs and started the next ones)."""
import os
import subprocess
import sys
import textwrap
import time
from concurrent import futures

from disa_jax import preemption
from disa_jax.pipeline import job_workers

# The parent starts one spawned pool worker with the initializer, then dies at once (os._exit, as
# a SIGKILL would: no cleanup). The worker "trains" until the preemption flag is set, then writes
# what it saw and returns, as a stage saving at its step boundary would.
PARENT = textwrap.dedent("""
    import multiprocessing, os, sys, time
    from concurrent import futures
    from disa_jax import preemption

    def stage(out):
      with preemption.watch():
        for step in range(600):
          if preemption.agreed():
            open(out, "w").write(f"{preemption.requested()} {step}")
            return
          time.sleep(0.05)
      open(out, "w").write("not stopped")

    if __name__ == "__main__":
      ex = futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"),
                                       initializer=preemption.stop_with_parent,
                                       initargs=(os.getpid(), 0.1))
      ex.submit(stage, sys.argv[1])
      ex.submit(stage, sys.argv[1] + ".next")  # queued: an orphan must never start it
      time.sleep(float(sys.argv[2]))  # the worker is inside its stage by now
      print("parent exits", flush=True)
      os._exit(0)
""")


def test_a_worker_stops_its_stage_once_its_parent_is_gone(tmp_path):
  script, out = tmp_path / "parent.py", tmp_path / "out.txt"
  script.write_text(PARENT)
  t0 = time.time()
  proc = subprocess.run([sys.executable, str(script), str(out), "8"], capture_output=True,
                        text=True, timeout=120, cwd=str(tmp_path))
  assert "parent exits" in proc.stdout, proc.stderr
  while not out.exists() and time.time() - t0 < 60:
    time.sleep(0.1)
  assert out.exists(), "the orphaned worker did not stop"
  signal_name, step = out.read_text().split()
  assert signal_name == "SIGTERM" and int(step) > 0  # stopped mid-stage, not before it began
  assert time.time() - t0 < 60  # (run() returned: the worker exited and closed its pipes)
  time.sleep(3)  # (a second stage would have started and, stopped at once, written by now)
  assert not (tmp_path / "out.txt.next").exists(), "the orphaned worker took the next stage"


def test_request_sets_the_flag_as_the_signal_would():
  with preemption.watch():
    assert not preemption.agreed()
    preemption.request()
    assert preemption.agreed() and preemption.requested() == "SIGTERM"
  assert preemption.requested() is None  # cleared when the outermost watch ends


def test_the_main_jobs_stage3_pool_stops_with_the_job(monkeypatch, tmp_path):
  """`SumJob.stage3_all` builds its pool (`job_workers.spawn_pool`) with the worker start that
  stops with the parent (`job_workers._start_worker` calls `preemption.stop_with_parent`)."""
  seen = {}

  class Pool(futures.ThreadPoolExecutor):
    def __init__(self, workers, **kwargs):
      seen.update(kwargs)
      super().__init__(workers)

  monkeypatch.setattr(job_workers.futures, "ProcessPoolExecutor", Pool)
  from tests.test_main_job import _cfg, _job
  job = _job(_cfg(methods=("grpo",), seeds=(3, 4), stage3_workers=2), tmp_path)
  try:
    job.stage3_all()
  except RuntimeError:
    pass  # (no models here: the runs fail; the pool's arguments are what this test reads)
  assert seen["initializer"] is job_workers._start_worker  # pylint: disable=protected-access
  assert seen["initargs"][0] == os.getpid()
  called = []
  monkeypatch.setattr(job_workers.preemption, "stop_with_parent", called.append)
  job_workers._start_worker(123, None)  # pylint: disable=protected-access
  assert called == [123]
