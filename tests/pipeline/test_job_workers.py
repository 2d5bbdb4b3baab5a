"""The main job's worker pool: each spawned worker on its own share of the job's CPUs
(`job_workers.cpu_shares`, `job_workers.spawn_pool`)."""
import os
import time

import pytest

from disa_jax.pipeline import job_workers


def _cpus_after(seconds: float) -> tuple[int, tuple[int, ...]]:
  """(pid, CPUs) of the worker that ran it, after holding that worker for ``seconds`` (so that
  the pool's other worker takes the next task)."""
  time.sleep(seconds)
  return os.getpid(), tuple(sorted(os.sched_getaffinity(0)))


@pytest.mark.parametrize("cpus, workers, want", [
    ((0, 1), 2, [(0,), (1,)]),
    ((0, 1, 2, 3, 4), 2, [(0, 1, 2), (3, 4)]),
    ((2, 5, 7, 9), 3, [(2, 5), (7,), (9,)]),
    ((0, 1), 1, []),  # one worker: nothing to split
    ((0,), 2, []),  # fewer CPUs than workers: every worker shares them
])
def test_the_cpus_are_split_into_disjoint_runs(monkeypatch, cpus, workers, want):
  monkeypatch.setattr(job_workers.os, "sched_getaffinity", lambda pid: set(cpus), raising=False)
  assert job_workers.cpu_shares(workers) == want


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs CPU affinity and at least 2 CPUs")
@pytest.mark.parametrize("pin", [True, False])
def test_each_worker_runs_on_its_own_share(pin):
  mine = tuple(sorted(os.sched_getaffinity(0)))
  with job_workers.spawn_pool(2, pin=pin) as ex:
    got = dict(f.result() for f in [ex.submit(_cpus_after, 3.0) for _ in range(2)])
  assert len(got) == 2, "both tasks ran in one worker"
  if pin:
    assert sorted(got.values()) == job_workers.cpu_shares(2)
  else:
    assert list(got.values()) == [mine, mine]
  assert tuple(sorted(os.sched_getaffinity(0))) == mine  # the job's own process is not pinned


class _Pool:
  """A stand-in for `spawn_pool` that runs each task at once in this process (submission order)."""

  def __init__(self, log):
    self.log = log

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    return False

  def submit(self, fn, *args):
    from concurrent import futures  # pylint: disable=g-import-not-at-top
    fut = futures.Future()
    try:
      fut.set_result(fn(*args))
    except Exception as e:  # pylint: disable=broad-except
      fut.set_exception(e)
    return fut


def test_work_after_the_runs_goes_to_the_pool_last_and_its_failure_is_named(monkeypatch):
  """``then`` is submitted after every unit (it fills the workers the last runs leave idle), its
  result recorded; with one worker it is left to the caller; its failure stops the job after the
  runs, named."""
  log = []
  monkeypatch.setattr(job_workers, "spawn_pool", lambda workers, pin: _Pool(log))
  monkeypatch.setattr(job_workers, "timed_stage3", lambda unit: log.append(unit) or 1.5)
  got = []
  job_workers.run_stage3_units([["a"], ["b"]], [["a"], ["b"]], 2,
                               lambda names, s: got.append((names, s)),
                               then=lambda: log.append("then") or {"reference": 2.0},
                               record_then=got.append)
  assert log == [["a"], ["b"], "then"]
  assert got == [(["a"], 1.5), (["b"], 1.5), {"reference": 2.0}]
  log.clear()
  job_workers.run_stage3_units([["a"]], [["a"]], 1, lambda names, s: None,
                               then=lambda: log.append("then"))
  assert log == [["a"]]

  def broken():
    raise ValueError("the evaluation of row 'reference' failed")

  with pytest.raises(RuntimeError, match=r"after the runs.*row 'reference' failed"):
    job_workers.run_stage3_units([["a"]], [["a"]], 2, lambda names, s: None, then=broken)


def test_the_tail_evaluates_only_the_rows_whose_runs_have_finished(tmp_path, monkeypatch):
  """`evaluate_ready` (the work the job puts after its Stage 3 units): a row whose run has not
  written its export and its summary yet is left to the job's evaluation stage, and the others
  are evaluated in their order."""
  done, half = tmp_path / "done", tmp_path / "half"
  for d in (done, half):
    (d / "final").mkdir(parents=True)
    (d / "final" / "export_info.json").write_text("{}")
  (done / "stage3_summary.json").write_text("{}")  # `half` is still writing its summary
  seen = []
  monkeypatch.setattr(job_workers, "evaluate_rows",
                      lambda cfgs, ref: seen.extend(cfgs) or {c: 1.0 for c in cfgs})
  files = lambda d: (str(d / "final" / "export_info.json"), str(d / "stage3_summary.json"))
  out = job_workers.evaluate_ready(["reference", "half", "done", "missing"],
                                   [(), files(half), files(done), files(tmp_path / "missing")],
                                   "ref")
  assert seen == ["reference", "done"] and set(out) == {"reference", "done"}
