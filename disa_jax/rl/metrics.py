"""Run metrics: one JSON line per step plus TensorBoard event files, resumable.

`MetricsLogger.write(step, metrics)` appends ``{"step": s, ...}`` to ``metrics.jsonl`` (flushed and
fsynced so that a killed process loses at most the line being written) and, when enabled, writes
the same scalars to TensorBoard event files through tensorboardX. On resume from a checkpoint at
step s, `MetricsLogger(..., resume_step=s)` first drops the JSONL lines with step > s: those steps
are recomputed by the resumed run, so the file ends up identical to an uninterrupted run's.
"""
from __future__ import annotations

import json
import math
import os
import sys
from typing import Any, Mapping

import numpy as np


def _to_float(name: str, v: Any) -> float:
  try:
    return float(np.asarray(v))
  except (TypeError, ValueError) as e:
    raise ValueError(f"metric {name!r} is not a scalar: {v!r}") from e


def _summary_writer_cls():
  """tensorboardX's SummaryWriter, imported without letting it pull in torch.

  tensorboardX imports torch opportunistically when it is installed (test environments have it);
  this package must not import torch, so the import runs with torch marked unavailable unless
  something else has imported it already.
  """
  if "torch" in sys.modules:
    from tensorboardX import SummaryWriter  # pylint: disable=g-import-not-at-top
    return SummaryWriter
  sys.modules["torch"] = None  # makes `import torch` raise ImportError, which tensorboardX handles
  try:
    from tensorboardX import SummaryWriter  # pylint: disable=g-import-not-at-top
  finally:
    del sys.modules["torch"]
  return SummaryWriter


def read_jsonl(path: str) -> list[dict[str, Any]]:
  """Parses a metrics file; a torn last line (killed writer) is skipped."""
  rows = []
  if not os.path.exists(path):
    return rows
  with open(path) as f:
    for line in f:
      line = line.strip()
      if not line:
        continue
      try:
        rows.append(json.loads(line))
      except json.JSONDecodeError:
        break
  return rows


class MetricsLogger:
  """JSONL (+ optional TensorBoard) metrics writer.

  Args:
    workdir: run directory; writes ``workdir/metrics.jsonl`` and ``workdir/tb/``.
    resume_step: when resuming from the checkpoint at this step, drop later JSONL lines; None for
      a fresh run (an existing file is then truncated).
    tensorboard: also write TensorBoard event files.
    filename: JSONL file name.
  """

  def __init__(self,
               workdir: str,
               *,
               resume_step: int | None = None,
               tensorboard: bool = True,
               filename: str = "metrics.jsonl"):
    os.makedirs(workdir, exist_ok=True)
    self.path = os.path.join(workdir, filename)
    kept = [] if resume_step is None else [
        r for r in read_jsonl(self.path) if int(r["step"]) <= resume_step
    ]
    with open(self.path, "w") as f:
      for r in kept:
        f.write(json.dumps(r, sort_keys=True) + "\n")
      f.flush()
      os.fsync(f.fileno())
    self._f = open(self.path, "a")
    self._tb = None
    if tensorboard:
      self._tb = _summary_writer_cls()(os.path.join(workdir, "tb"), purge_step=resume_step)

  def write(self, step: int, metrics: Mapping[str, Any]) -> dict[str, float]:
    """Writes one step's scalar metrics; returns them as Python floats."""
    row = {k: _to_float(k, v) for k, v in metrics.items()}
    rec = {"step": int(step), **{k: (v if math.isfinite(v) else str(v)) for k, v in row.items()}}
    self._f.write(json.dumps(rec, sort_keys=True) + "\n")
    self._f.flush()
    os.fsync(self._f.fileno())
    if self._tb is not None:
      for k, v in row.items():
        if math.isfinite(v):
          self._tb.add_scalar(k, v, global_step=int(step))
    return row

  def flush(self) -> None:
    self._f.flush()
    if self._tb is not None:
      self._tb.flush()

  def close(self) -> None:
    self._f.close()
    if self._tb is not None:
      self._tb.close()

  def __enter__(self) -> "MetricsLogger":
    return self

  def __exit__(self, *exc) -> None:
    self.close()
