"""The main job's units of work and the processes that run them.

`SumJob` (`pipeline.sum_job`) decides what to run; this module runs it: a Stage 3 unit (one run, or
several seeds of one run trained together, `seed_batch.train_together`) and a share of evaluation
rows, in this process or on a pool of spawned workers (JAX never forks) that stop with the job
(`preemption.stop_with_parent`), each pinned to its own share of the job's CPUs (`cpu_shares`).
"""
from __future__ import annotations

import dataclasses
import functools
import multiprocessing
import os
import queue
import time
from concurrent import futures
from pathlib import Path
from typing import Any, Callable, Sequence, TypeVar

from disa_jax import preemption
from disa_jax.rl import seed_batch
from disa_jax.workflows.evaluation import EvalConfig, EvalResult, run_evaluation
from disa_jax.workflows.stage3 import Stage3Config, run_stage3

K = TypeVar("K")


def cpu_shares(workers: int) -> list[tuple[int, ...]]:
  """The CPUs this process may run on, split into ``workers`` disjoint runs of consecutive CPUs
  (the first ones one CPU larger where they do not divide evenly); [] where there is nothing to
  split: one worker, fewer CPUs than workers, or a platform without CPU affinity."""
  if workers < 2 or not hasattr(os, "sched_getaffinity"):
    return []
  cpus = sorted(os.sched_getaffinity(0))
  if len(cpus) < workers:
    return []
  per, extra = divmod(len(cpus), workers)
  bounds = [0]
  for i in range(workers):
    bounds.append(bounds[-1] + per + (i < extra))
  return [tuple(cpus[lo:hi]) for lo, hi in zip(bounds[:-1], bounds[1:])]


def _start_worker(parent: int, shares: Any) -> None:
  """A pool worker's start: it takes one share of CPUs from ``shares`` (a queue; None: no
  pinning), before anything imports JAX (whose CPU thread pool is sized to the CPUs it may use),
  and stops with the job's process."""
  if shares is not None:
    try:
      os.sched_setaffinity(0, shares.get_nowait())
    except queue.Empty:  # (a worker beyond the shares runs on every CPU)
      pass
  preemption.stop_with_parent(parent)


def spawn_pool(workers: int, *, pin: bool = True) -> futures.ProcessPoolExecutor:
  """``workers`` spawned processes, each stopping its work (at the next step, with a checkpoint)
  when the job's process is gone. They are not daemons: a Stage 3 run starts its own engine
  worker (on its worker's CPUs).

  With ``pin`` each worker runs on its own share of this process's CPUs (`cpu_shares`): on a
  2-core CPU, two Stage 3 runs of the default job at once take 0.91x the wall time of two
  unpinned ones, the same results bit for bit (benchmarks/results/worker_pinning_cpu.json).
  """
  ctx = multiprocessing.get_context("spawn")
  shares = cpu_shares(workers) if pin else []
  box = None
  if shares:
    box = ctx.Queue()
    for share in shares:
      box.put(share)
  return futures.ProcessPoolExecutor(workers, mp_context=ctx, initializer=_start_worker,
                                     initargs=(os.getpid(), box))


def together(cfg: Stage3Config) -> Stage3Config:
  """A seed's Stage 3 config as `seed_batch.train_together` runs it: its sampler in this process
  (its programs batched with the other seeds'), its checkpoints written synchronously (orbax's
  asynchronous writes from several threads at once collide)."""
  train = cfg.train
  return dataclasses.replace(
      cfg, engine=dataclasses.replace(cfg.engine, separate_process=False),
      train=dataclasses.replace(train, checkpoint=dataclasses.replace(train.checkpoint,
                                                                      async_save=False)))


def timed_stage3(cfgs: Sequence[Stage3Config]) -> float:
  """`run_stage3` of one run, or of several seeds of one run trained together (one thread per
  seed, the samplers in this process); returns its seconds. A run stopped by a preemption signal
  raises (its checkpoint is saved: the job's rerun resumes it)."""
  t0 = time.time()
  if len(cfgs) == 1:
    runs = [run_stage3(cfgs[0])]
  else:
    runs = seed_batch.train_together([functools.partial(run_stage3, together(c)) for c in cfgs])
  for cfg, run in zip(cfgs, runs):
    if run.preempted is not None:
      raise RuntimeError(f"Stage 3 run {cfg.workdir} was stopped by a preemption signal at step "
                         f"{run.preempted} (checkpoint saved); rerun the job to resume")
  return round(time.time() - t0, 2)


def stage3_units(todo: Sequence[K], method_of: Callable[[K], str], size: int,
                 work_of: Callable[[K], tuple[int, bool]] = lambda k: (1, False)
                 ) -> list[list[K]]:
  """The runs of ``todo`` as units of work: each method's runs in chunks of at most ``size``
  (trained together), the most work first, so that the longest jobs start first on the workers
  and the short ones fill the end (a run's work: ``work_of(run)``, `TrainConfig.work`, its
  sequences times the unit's runs, then whether a trainable objective state adds a pass); ties
  in the order of ``todo``. (The default job in method order ended with one FlowRL run of 54 s
  alone on two workers.)"""
  units = []
  for m in dict.fromkeys(method_of(k) for k in todo):
    mine = [k for k in todo if method_of(k) == m]
    units += [mine[i:i + size] for i in range(0, len(mine), size)]

  def work(unit: list[K]) -> tuple[int, bool]:
    sequences, state = work_of(unit[0])
    return len(unit) * sequences, state

  return sorted(units, key=work, reverse=True)


def run_stage3_units(units: Sequence[Sequence[Stage3Config]], names: Sequence[Sequence[str]],
                     workers: int, record: Callable[[Sequence[str], float], None], *,
                     pin: bool = True, then: Callable[[], Any] | None = None,
                     record_then: Callable[[Any], None] = lambda _: None) -> None:
  """`timed_stage3` of each unit (``names[i]``: the runs of ``units[i]``), ``record(names,
  seconds)`` as each one ends.

  With one worker the units go one after another here, the first failure raising (naming the
  unit's runs when it has several). With more, each unit goes to the `spawn_pool` (its workers
  pinned to their own CPUs with ``pin``); a failed unit raises here naming its runs, after the
  others finish. ``then`` (picklable; work that needs no Stage 3 run, e.g. the evaluation of the
  reference and the proposal) is submitted after the units, so it runs on the first worker that
  the last units leave idle; ``record_then(its result)``. With one worker it is not run here (the
  caller's later stages do that work).
  """
  if workers <= 1:
    for unit, unit_names in zip(units, names):
      try:
        record(unit_names, timed_stage3(unit))
      except Exception as e:  # pylint: disable=broad-except
        if len(unit) == 1:
          raise
        raise RuntimeError(f"Stage 3 runs failed: { {n: e for n in unit_names} }") from e
    return
  failed = {}
  with spawn_pool(workers, pin=pin) as ex:
    pending = [(unit_names, ex.submit(timed_stage3, unit)) for unit, unit_names in zip(units, names)]
    after = ex.submit(then) if then is not None else None
    for unit_names, fut in pending:
      try:
        record(unit_names, fut.result())
      except Exception as e:  # pylint: disable=broad-except
        failed.update({n: e for n in unit_names})
    if after is not None:
      try:
        record_then(after.result())
      except Exception as e:  # pylint: disable=broad-except
        failed["(after the runs)"] = e
  if failed:
    raise RuntimeError(f"Stage 3 runs failed: {failed}") from next(iter(failed.values()))


def evaluated(cfg: EvalConfig) -> bool:
  """Whether the evaluation ``cfg`` has written its first benchmark (the rows a worker skips)."""
  return (Path(cfg.output_dir) / "task.json").exists()


def evaluate_rows(cfgs: Sequence[EvalConfig], ref_path: str,
                  results: dict[str, EvalResult] | None = None) -> dict[str, float]:
  """`run_evaluation` of each config in this process, one engine (built from ``ref_path`` for the
  first row with work left, its weights swapped between rows); each result stored in ``results``
  under its label. Returns the seconds of each row evaluated here (not of one read back)."""
  seconds, engine = {}, None
  try:
    for cfg in cfgs:
      done, t0 = evaluated(cfg), time.time()
      try:
        if engine is None and not done:
          engine = cfg.engine.make(ref_path)
        result = run_evaluation(cfg, engine=engine)
      except preemption.Stopped:  # its rows so far are saved: the job's rerun resumes it
        raise
      except Exception as e:  # pylint: disable=broad-except  (a worker's error names its row)
        raise RuntimeError(f"the evaluation of row {cfg.label!r} ({cfg.model_path}) failed: "
                           f"{type(e).__name__}: {e}") from e
      if results is not None:
        results[cfg.label] = result
      if not done:
        seconds[cfg.label] = round(time.time() - t0, 2)
  finally:
    if engine is not None:
      engine.close()
  return seconds


def evaluate_ready(cfgs: Sequence[EvalConfig], ready: Sequence[Sequence[str]], ref_path: str
                   ) -> dict[str, float]:
  """`evaluate_rows` of the configs whose every file of ``ready[i]`` exists now (a Stage 3 row:
  its run's export and summary; none: always), in order; the others are left to the job's
  evaluation stage. The job runs it after its Stage 3 units, so it evaluates the rows of every run
  but those still running on the other workers."""
  return evaluate_rows([c for c, files in zip(cfgs, ready) if all(Path(f).exists() for f in files)],
                       ref_path)


def evaluate_in_workers(cfgs: Sequence[EvalConfig], ref_path: str, workers: int,
                        record: Callable[[str, float], None], *, pin: bool = True) -> None:
  """The rows of ``cfgs`` not yet evaluated, dealt round-robin to ``workers`` spawned processes
  (`evaluate_rows` in each; pinned as `spawn_pool`'s), ``record(label, seconds)`` for each row
  evaluated there."""
  todo = [cfg for cfg in cfgs if not evaluated(cfg)]
  workers = min(workers, len(todo))
  if workers <= 1:
    return
  shares = [list(todo[i::workers]) for i in range(workers)]
  with spawn_pool(workers, pin=pin) as ex:
    for seconds in ex.map(evaluate_rows, shares, [ref_path] * workers):
      for row, s in seconds.items():
        record(row, s)
