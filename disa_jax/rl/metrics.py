"""Run metrics: one JSON line per step plus TensorBoard event files and wandb, resumable.

`MetricsLogger.write(step, metrics)` appends ``{"step": s, ...}`` to ``metrics.jsonl`` (flushed and
fsynced so that a killed process loses at most the line being written) and, when enabled, writes
the same scalars to TensorBoard event files through tensorboardX. On resume from a checkpoint at
step s, `MetricsLogger(..., resume_step=s)` first drops the JSONL lines with step > s: those steps
are recomputed by the resumed run, so the file ends up identical to an uninterrupted run's. The
file is rewritten atomically (a temporary file renamed over it).

A damaged line (a bit flip, a NUL run left by a crashed file system: anything but an object with an
integer ``step``, unlike a torn last line, which is only a killed write) never shortens the file:
`scan_jsonl` reads every line and reports the damaged ones; `MetricsLogger` keeps every intact row,
copies the file as found to ``metrics.jsonl.damaged-<n>`` and warns naming each damaged line and
its error. The rows the damage lost are recomputed when a checkpoint before them is left: the
`Trainer` resumes from it (`JsonlScan.first_lost_step`), not from the latest.

With ``wandb=WandbConfig(enabled=True, ...)`` the same rows go to Weights & Biases (`WandbSink`): the
run's resolved config is uploaded at start, and its id is kept in ``workdir/wandb_run.json`` so
that a resumed run continues the same wandb run; the steps that run had already logged (recomputed
identically after the resume) are not sent twice.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import sys
import warnings
from typing import Any, Mapping

import numpy as np

from disa_jax.checkpoint.files import naming
from disa_jax.rl.config import WandbConfig

WANDB_STATE_FILE = "wandb_run.json"
METRICS_FILE = "metrics.jsonl"


def _to_float(name: str, v: Any) -> float:
  try:
    return float(np.asarray(v))
  except (TypeError, ValueError) as e:
    raise ValueError(f"metric {name!r} is not a scalar: {v!r}") from e


def _tensorboard_classes():
  """tensorboardX's ``(SummaryWriter, Summary)`` (the writer and the event's summary proto),
  imported without letting it pull in torch.

  tensorboardX imports torch opportunistically when it is installed (test environments have it);
  this package must not import torch, so the import runs with torch marked unavailable unless
  something else has imported it already.
  """
  guard = "torch" not in sys.modules
  if guard:
    sys.modules["torch"] = None  # `import torch` raises ImportError, which tensorboardX handles
  try:
    # Optional heavy dependency, imported with torch kept out (see above).
    from tensorboardX import SummaryWriter  # pylint: disable=g-import-not-at-top  (see above)
    from tensorboardX.proto.summary_pb2 import Summary  # pylint: disable=g-import-not-at-top  (same)
  finally:
    if guard:
      del sys.modules["torch"]
  return SummaryWriter, Summary


@dataclasses.dataclass(frozen=True)
class JsonlScan:
  """A metrics file, line by line (`scan_jsonl`).

  Attributes:
    rows: the intact rows (JSON objects with an integer ``step``), in file order.
    lines: each row's line number (1-based).
    damaged: ``(line number, why)`` of every complete line that is not an intact row.
    torn: the last line was cut short without a newline (a killed writer; not damage).
  """
  rows: tuple[dict[str, Any], ...] = ()
  lines: tuple[int, ...] = ()
  damaged: tuple[tuple[int, str], ...] = ()
  torn: bool = False

  def first_lost_step(self) -> int | None:
    """The earliest step the first damaged line can have held: the step after the last intact
    row above it (0 when none is); None when no line is damaged."""
    if not self.damaged:
      return None
    above = [r["step"] for r, n in zip(self.rows, self.lines) if n < self.damaged[0][0]]
    return above[-1] + 1 if above else 0


def _parse_row(raw: bytes) -> dict[str, Any]:
  row = json.loads(raw.decode("utf-8"))
  step = row.get("step") if isinstance(row, dict) else None
  if not isinstance(step, int) or isinstance(step, bool):
    raise ValueError(f"not a metrics row (an object with an integer 'step'): {raw[:80]!r}")
  return row


def scan_jsonl(path: str) -> JsonlScan:
  """Reads every line of a metrics file (a missing file has none); see `JsonlScan`."""
  rows, lines, damaged, torn = [], [], [], False
  if not os.path.exists(path):
    return JsonlScan()
  with open(path, "rb") as f:
    for n, raw in enumerate(f, 1):
      if not raw.strip():
        continue
      try:
        rows.append(_parse_row(raw))
        lines.append(n)
      except ValueError as e:  # (JSONDecodeError and UnicodeDecodeError are ValueErrors)
        if raw.endswith(b"\n"):
          damaged.append((n, f"{type(e).__name__}: {str(e)[:200]}"))
        else:
          torn = True
  return JsonlScan(tuple(rows), tuple(lines), tuple(damaged), torn)


def read_jsonl(path: str) -> list[dict[str, Any]]:
  """Every intact row of a metrics file; a torn last line (killed writer) and damaged lines are
  skipped (`scan_jsonl` reports them)."""
  return list(scan_jsonl(path).rows)


def _set_aside(path: str) -> str:
  """Copies ``path`` to the first free ``<path>.damaged-<n>`` (n = 1, 2, ...); returns that name."""
  n = 1
  while os.path.exists(f"{path}.damaged-{n}"):
    n += 1
  aside = f"{path}.damaged-{n}"
  with naming(aside, "a copy of a damaged metrics file"):
    shutil.copyfile(path, aside)
  return aside


def _rewrite(path: str, rows: list[dict[str, Any]]) -> None:
  """Replaces ``path`` by ``rows`` atomically (a killed rewrite leaves the old file)."""
  tmp = path + ".tmp"
  with naming(tmp, "the run's metrics"):
    with open(tmp, "w") as f:
      f.write("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)


class WandbSink:
  """Sends metrics rows to one wandb run, continued across resumes.

  Args:
    cfg: the ``train.wandb`` section (`WandbConfig`), enabled.
    workdir: the run directory: holds ``wandb_run.json`` (the run id and the last step sent) and,
      in offline mode, wandb's own ``wandb/`` folder.
    resume_step: the checkpoint step a resumed run restarts from; None for a fresh run (a new wandb
      run, whatever ``wandb_run.json`` held).
    run_config: the run's resolved config (JSON-ready), uploaded as the wandb config.
  """

  def __init__(self, cfg: WandbConfig, workdir: str, *, resume_step: int | None,
               run_config: Mapping[str, Any]):
    try:
      import wandb  # pylint: disable=g-import-not-at-top  # optional extra: only when enabled
    except ImportError as e:
      raise ImportError("train.wandb.enabled=True needs the wandb package: pip install "
                        "'disa_jax[wandb]'") from e
    self._wandb = wandb
    self._state_path = os.path.join(workdir, WANDB_STATE_FILE)
    state = self._read_state() if resume_step is not None else None
    self.last_step = int(state["last_step"]) if state else -1
    self.run = wandb.init(
        project=cfg.project, entity=cfg.entity or None, id=state["id"] if state else None,
        resume="allow",
        name=cfg.name or os.path.basename(os.path.abspath(workdir)), tags=list(cfg.tags),
        mode=cfg.mode, dir=workdir, config=dict(run_config), reinit="create_new")
    self._write_state()

  def _read_state(self) -> dict[str, Any] | None:
    if not os.path.exists(self._state_path):
      return None
    try:
      with open(self._state_path) as f:
        state = json.load(f)
      return {"id": str(state["id"]), "last_step": int(state["last_step"])}
    except (OSError, ValueError, KeyError, TypeError) as e:
      raise ValueError(f"{self._state_path}: unreadable wandb run state ({e}); delete it to start "
                       "a new wandb run") from e

  def _write_state(self) -> None:
    tmp = self._state_path + ".tmp"
    with open(tmp, "w") as f:
      json.dump({"id": self.run.id, "last_step": self.last_step}, f)
    os.replace(tmp, self._state_path)

  def log(self, step: int, row: Mapping[str, float]) -> None:
    """Logs one row at ``step``; a step at or below the last one sent is skipped."""
    if step <= self.last_step:
      return
    self.run.log(dict(row), step=int(step))
    self.last_step = int(step)
    self._write_state()

  def close(self) -> None:
    """Finishes the run and waits until wandb's service has written all of it.

    ``run.finish()`` alone returns before the service has flushed the run's record log: read at
    once (a `wandb sync` right after, or this project's tests), 4 of 15 offline runs had no run
    record yet. `wandb.teardown` waits for the service to exit; a later run starts a new one.
    """
    self.run.finish()
    self._wandb.teardown()


class MetricsLogger:
  """JSONL (+ optional TensorBoard) metrics writer.

  Args:
    workdir: run directory; writes ``workdir/metrics.jsonl`` and ``workdir/tb/``.
    resume_step: when resuming from the checkpoint at this step, drop later JSONL lines; None for
      a fresh run (an existing file is then truncated). Damaged lines are reported and the file
      as found is copied aside first (see the module docstring).
    tensorboard: also write TensorBoard event files.
    filename: JSONL file name.
    wandb: the ``train.wandb`` section; when enabled, rows also go to wandb (`WandbSink`).
    run_config: the run's resolved config, uploaded to wandb.
  """

  def __init__(self,
               workdir: str,
               *,
               resume_step: int | None = None,
               tensorboard: bool = True,
               filename: str = METRICS_FILE,
               wandb: WandbConfig = WandbConfig(),
               run_config: Mapping[str, Any] | None = None):
    os.makedirs(workdir, exist_ok=True)
    self.path = os.path.join(workdir, filename)
    scan = scan_jsonl(self.path)
    if scan.damaged:
      self._report_damage(scan, resume_step)
    _rewrite(self.path, [] if resume_step is None else
             [r for r in scan.rows if r["step"] <= resume_step])
    with naming(self.path, "the run's metrics"):
      self._f = open(self.path, "a")
    self._tb = self._summary = None
    if tensorboard:
      writer_cls, self._summary = _tensorboard_classes()
      # tensorboardX names a file by the second it opened it: a resume within the same second
      # would truncate the earlier file without a suffix of its own.
      self._tb = writer_cls(os.path.join(workdir, "tb"), purge_step=resume_step,
                            filename_suffix="" if resume_step is None else f".from{resume_step}")
    self._wandb = (WandbSink(wandb, workdir, resume_step=resume_step, run_config=run_config or {})
                   if wandb.enabled else None)

  def _report_damage(self, scan: JsonlScan, resume_step: int | None) -> None:
    """Copies the damaged file aside and warns naming its damaged lines."""
    aside = _set_aside(self.path)
    shown = "; ".join(f"line {n}: {why}" for n, why in scan.damaged[:5])
    more = f"; and {len(scan.damaged) - 5} more" if len(scan.damaged) > 5 else ""
    kept = ("no row is kept (a fresh run)" if resume_step is None else
            f"its intact rows up to step {resume_step} are kept, later steps are computed again")
    warnings.warn(f"{self.path}: {len(scan.damaged)} damaged line(s) ({shown}{more}); the file as "
                  f"found is kept as {aside}; {kept}", RuntimeWarning)

  def write(self, step: int, metrics: Mapping[str, Any]) -> dict[str, float]:
    """Writes one step's scalar metrics; returns them as Python floats.

    Raises:
      OutputWriteError: the file system refused the write (it names the file).
    """
    row = {k: _to_float(k, v) for k, v in metrics.items()}
    rec = {"step": int(step), **{k: (v if math.isfinite(v) else str(v)) for k, v in row.items()}}
    with naming(self.path, "the run's metrics"):
      self._f.write(json.dumps(rec, sort_keys=True) + "\n")
      self._f.flush()
      os.fsync(self._f.fileno())
    if self._tb is not None:  # one event holding every finite scalar of the step (one
      # add_scalar per metric cost ~5.8 ms a step of 44 metrics, a twentieth of a default-job step)
      values = [self._summary.Value(tag=k, simple_value=v) for k, v in row.items()
                if math.isfinite(v)]
      self._tb.file_writer.add_summary(self._summary(value=values), int(step))
    if self._wandb is not None:
      self._wandb.log(int(step), row)
    return row

  def flush(self) -> None:
    self._f.flush()
    if self._tb is not None:
      self._tb.flush()

  def close(self) -> None:
    self._f.close()
    if self._tb is not None:
      self._tb.close()
    if self._wandb is not None:
      self._wandb.close()

  def __enter__(self) -> "MetricsLogger":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


# What the step did, averaged over the steps since the previous measurement (issue 62 item 6): the
# mean TB residual E[delta] (the baseline the log Z provides), the pre-clip gradient norm and the
# share of clipped updates. Written into each measurement's row as ``window/<key>``.
WINDOW_KEYS = ("tb_residual_mean", "grad_norm", "grad_clipped_share")


class StepWindow:
  """The means of `WINDOW_KEYS` over the steps since the previous measurement (`add` each step's
  metrics; `close` at a measurement returns ``{'window/<key>': mean}`` and starts a new window).
  A key a step lacks (an objective without a TB residual) is left out. Every step has the same
  number of optimizer updates, so the mean of the steps' ``grad_clipped_share`` is the share of
  the window's updates that were clipped.
  """

  def __init__(self, rows: tuple[Mapping[str, Any], ...] = ()):
    self._rows = [dict(r) for r in rows]

  @classmethod
  def resumed(cls, path: str, step: int, due) -> "StepWindow":
    """The window of a run resumed after ``step`` steps: the rows of ``path`` (its metrics file)
    after the last measurement (``due(s)``) up to ``step``, so a resumed run writes the window
    an uninterrupted one would."""
    last = max((s for s in range(1, step + 1) if due(s)), default=0)
    return cls(tuple(r for r in read_jsonl(path) if last < r["step"] <= step))

  def add(self, metrics: Mapping[str, Any]) -> None:
    self._rows.append({k: float(metrics[k]) for k in WINDOW_KEYS if k in metrics})

  def close(self) -> dict[str, float]:
    rows, self._rows = self._rows, []
    out = {}
    for k in WINDOW_KEYS:
      vals = [r[k] for r in rows if k in r]
      if vals:
        out[f"window/{k}"] = float(np.mean(vals))
    return out
