"""Asynchronous rollouts with bounded staleness (``rollout.max_staleness`` = k > 0).

The engine (its own generation process in production) samples while the trainer updates. One
rollout thread owns the engine and runs its calls in the order they were submitted, so engine calls
never overlap. After the update of step t (the weights are then version t + 1) the trainer submits

    push(weights t + 1), then sample(step t + 1 + k)

so the batch of step s is always sampled by the weights after max(s - k, 0) updates, whatever the
threads' timing: a run is as deterministic as the synchronous loop (k = 0), and its batches are
exactly k updates stale once the pipeline is full. The trainer waits only when the batch it needs
is not ready yet; the engine waits only when k batches are ahead.

Collectives stay on the main thread, in step order on every process: the all-gather of a batch
(`RolloutCollector.finish`, when the trainer takes it) and the host copy of the weights
(`disa_jax.rollout.multihost.host_weights`, called by `PolicyUpdater.queue_push`). The rollout
thread runs only this host's engine, so multi-host runs (one generation process per host) keep
working.

Checkpoints and resume: a checkpoint after S steps holds the weights of version S, but the batches
of steps S .. S + k - 1 were sampled by older weights (max(s - k, 0) < S). They are written beside
the checkpoint (`save_batches`, ``<workdir>/in_flight/<S>.npz``) and taken from there on resume;
step S + k is sampled again from the checkpoint's weights. A rerun after ``kill -9`` therefore
continues exactly as the uninterrupted run.
"""
from __future__ import annotations

import concurrent.futures
import json
import os
from pathlib import Path
from typing import Mapping

import numpy as np

from disa_jax.rl.batch import RolloutBatch
from disa_jax.rl.collect import LocalRollout, RolloutCollector
from disa_jax.rollout.types import Engine


def sampled_version(step: int, max_staleness: int) -> int:
  """The weights' version (optimizer steps) that samples the batch of ``step``: max(step - k, 0)."""
  return max(step - max_staleness, 0)


class RolloutPipeline:
  """Keeps up to k + 1 rollout batches in flight ahead of the trainer (see the module docstring).

  Args:
    collector: the run's `RolloutCollector` (its ``sample`` runs on the rollout thread, its
      ``finish`` on the caller's).
    engine: this host's engine (None on processes that do not lead a host: they sample nothing).
    max_staleness: k >= 1.
  """

  def __init__(self, collector: RolloutCollector, engine: Engine | None, max_staleness: int):
    if max_staleness < 1:
      raise ValueError(f"RolloutPipeline needs max_staleness >= 1, got {max_staleness}")
    self.collector, self.engine, self.k = collector, engine, max_staleness
    self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1,
                                                       thread_name_prefix="disa-rollout")
    self._pending: dict[int, concurrent.futures.Future] = {}
    self._ready: dict[int, RolloutBatch] = {}
    # The weight pushes queued so far, and (push number, error) of those that failed: a failed push
    # is the cause of a later sampling's failure (a dead generation process fails the push first;
    # the sampling after it only finds the engine closed).
    self._pushes, self._push_errors = 0, []
    self._pushes_before: dict[int, int] = {}

  def _submit_sample(self, step: int) -> None:
    self._pushes_before[step] = self._pushes
    self._pending[step] = self._pool.submit(self.collector.sample, step,
                                            sampled_version(step, self.k))

  def start(self, step: int, ready: Mapping[int, RolloutBatch]) -> None:
    """Fills the pipeline for a run at ``step``: the batches of steps step .. step + k, from
    ``ready`` (restored from a checkpoint) or sampled now. The engine must hold the weights of
    version ``step``."""
    for s in range(step, step + self.k + 1):
      if s in ready:
        if ready[s].policy_version != sampled_version(s, self.k):
          raise ValueError(f"restored rollout batch of step {s} was sampled by weights "
                           f"{ready[s].policy_version}, expected {sampled_version(s, self.k)}")
        self._ready[s] = ready[s]
      else:
        self._submit_sample(s)

  def _resolve(self, step: int) -> RolloutBatch:
    if step not in self._ready:
      if step not in self._pending:
        raise RuntimeError(f"rollout batch of step {step} was never submitted (pipeline at "
                           f"{sorted(self._pending)})")
      local: LocalRollout = self._result(self._pending.pop(step), self._pushes_before.pop(step))
      self._ready[step] = self.collector.finish(local)  # collective, in step order
    return self._ready[step]

  def _result(self, future: concurrent.futures.Future, pushes_before: int) -> LocalRollout:
    """``future``'s result; if it failed after a failed push (one of the first ``pushes_before``),
    that push's error, raised from the sampling's."""
    try:
      return future.result()
    except BaseException as e:
      push = self._failed_push(pushes_before)
      if push is None:
        raise
      raise push from e

  def _failed_push(self, pushes_before: int | None = None) -> BaseException | None:
    """The error of the first failed push (of the first ``pushes_before``; None: of all)."""
    return next((e for i, e in self._push_errors if pushes_before is None or i < pushes_before),
                None)

  def _push(self, weights: Mapping[str, np.ndarray]) -> None:
    number, self._pushes = self._pushes, self._pushes + 1
    future = self._pool.submit(self.engine.update_weights, weights)
    future.add_done_callback(lambda f: f.cancelled() or f.exception() is None
                             or self._push_errors.append((number, f.exception())))

  def take(self, step: int) -> RolloutBatch:
    """The batch of ``step``, waiting for its sampling if needed (collective)."""
    batch = self._resolve(step)
    del self._ready[step]
    return batch

  def advance(self, done: int, weights: Mapping[str, np.ndarray] | None) -> None:
    """After ``done`` updates: queues the push of ``weights`` (version ``done``; None on processes
    without an engine), then the sampling of step done + k."""
    if self.engine is not None:
      if weights is None:
        raise ValueError("the host leader's rollout pipeline got no weights to push")
      self._push(weights)
    self._submit_sample(done + self.k)

  def wait_idle(self) -> None:
    """Returns once every queued engine call has run (the engine then holds the last pushed
    weights and is free for the caller's own calls, e.g. validation)."""
    self._pool.submit(lambda: None).result()
    push = self._failed_push()
    if push is not None:
      raise push
    for f in list(self._pending.values()):
      if f.done() and f.exception() is not None:
        raise f.exception()

  def in_flight(self, step: int) -> dict[int, RolloutBatch]:
    """At a checkpoint after ``step`` updates: the batches of steps >= ``step`` sampled by older
    weights (collective: gathers them)."""
    return {s: self._resolve(s) for s in range(step, step + self.k)
            if sampled_version(s, self.k) < step}

  def close(self) -> None:
    for f in self._pending.values():
      f.cancel()
    self._pool.shutdown(wait=True)
    self._pending.clear()


# -- the in-flight batches beside a checkpoint ---------------------------------------------------

_ARRAYS = ("reward", "grade_error", "is_replay", "stored_ref_logp")


def _ragged(parts: list[np.ndarray | None], dtype) -> tuple[np.ndarray, np.ndarray]:
  """``[B]`` arrays (None allowed) -> (concatenation, lengths with -1 for None)."""
  lengths = np.asarray([-1 if p is None else len(p) for p in parts], np.int64)
  flat = [np.asarray(p, dtype) for p in parts if p is not None]
  return (np.concatenate(flat) if flat else np.zeros(0, dtype)), lengths


def _unragged(flat: np.ndarray, lengths: np.ndarray) -> list[np.ndarray | None]:
  out, at = [], 0
  for n in lengths.tolist():
    if n < 0:
      out.append(None)
    else:
      out.append(flat[at:at + n].copy())
      at += n
  return out


def save_batches(path: str | os.PathLike, batches: Mapping[int, RolloutBatch]) -> None:
  """Writes unscored rollout batches (`RolloutBatch`, never a `ScoredBatch`) to ``path`` (.npz,
  no pickle), atomically."""
  arrays, meta = {}, {}
  for s, b in batches.items():
    p = f"{s}/"
    meta[str(s)] = {"prompt_ids": b.prompt_ids, "group_size": b.group_size,
                    "response_width": b.response_width, "finish_reason": b.finish_reason,
                    "generate_s": b.generate_s, "policy_version": b.policy_version}
    for name, parts, dtype in (("prompt_tokens", b.prompt_tokens, np.int32),
                               ("response_ids", b.response_ids, np.int32),
                               ("sampled_logp", b.sampled_logp, np.float32),
                               ("engine_logp", b.engine_logp, np.float32)):
      arrays[p + name], arrays[p + name + "_len"] = _ragged(list(parts), dtype)
    for name in _ARRAYS:
      arrays[p + name] = getattr(b, name)
  arrays["meta"] = np.asarray(json.dumps(meta))
  path = Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_suffix(f".tmp{os.getpid()}")
  with open(tmp, "wb") as f:
    np.savez(f, **arrays)
  os.replace(tmp, path)


def load_batches(path: str | os.PathLike) -> dict[int, RolloutBatch]:
  """The batches `save_batches` wrote, by step."""
  with np.load(path, allow_pickle=False) as z:
    meta = json.loads(str(z["meta"]))
    out = {}
    for key, m in meta.items():
      p = f"{key}/"
      rag = {name: _unragged(z[p + name], z[p + name + "_len"])
             for name in ("prompt_tokens", "response_ids", "sampled_logp", "engine_logp")}
      out[int(key)] = RolloutBatch(
          prompt_ids=list(m["prompt_ids"]),
          prompt_tokens=[tuple(int(t) for t in x) for x in rag["prompt_tokens"]],
          group_size=int(m["group_size"]), response_width=int(m["response_width"]),
          response_ids=rag["response_ids"], sampled_logp=rag["sampled_logp"],
          engine_logp=rag["engine_logp"], finish_reason=list(m["finish_reason"]),
          generate_s=float(m["generate_s"]), policy_version=int(m["policy_version"]),
          **{name: z[p + name].copy() for name in _ARRAYS})
  return out
