"""Checkpoint selection as in the paper (App. D, "Checkpoint selection"): the checkpoint reported for a
run is the one best on a held-out validation subset of the training corpus, under the test protocol
(Mean@8 for math, pass@1 for code).

During Stage 3 the `Trainer` validates at step 0 (``train.validation.at_start``) and every
``train.validation.every`` steps, records each score in a `Selection` carried in every checkpoint's
metadata (``meta["selection"]``), saves a checkpoint at each new best and protects it from
``train.checkpoint.keep``'s retention. `choose_step` reads the latest checkpoint's record and
returns the step that export and evaluation take ('best' by default, or 'latest', or a step
number), with the reason they log and write into their summaries.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from disa_jax import codec
from disa_jax.checkpoint import verify
from disa_jax.checkpoint.verify import CheckpointUnreadableError


@dataclasses.dataclass(frozen=True)
class Selection:
  """The validation scores of a run so far.

  Attributes:
    metric: the validation metric selected on (higher is better), e.g. ``'eval/mean@8'``.
    scores: ``(step, value)`` for every validation, in step order.
  """
  metric: str
  scores: tuple[tuple[int, float], ...] = codec.field(default=(), required=True)

  @property
  def best(self) -> tuple[int, float] | None:
    """``(step, value)`` of the highest score (the earliest step on ties), or None."""
    if not self.scores:
      return None
    top = max(v for _, v in self.scores)
    return next((s, v) for s, v in self.scores if v == top)

  @property
  def best_step(self) -> int | None:
    return None if self.best is None else self.best[0]

  def add(self, step: int, value: float) -> "Selection":
    """This record with ``value`` at ``step`` (a rerun of a step replaces its earlier score)."""
    kept = tuple((s, v) for s, v in self.scores if s < step)
    return dataclasses.replace(self, scores=kept + ((int(step), float(value)),))

  def json_extra(self) -> dict[str, Any]:
    """The keys `codec.encode` writes after the fields (derived: not read back)."""
    return {"best_step": self.best_step, "best_value": None if self.best is None else self.best[1]}

  def to_json(self) -> dict[str, Any]:
    return codec.encode(self)

  @classmethod
  def from_json(cls, d: dict[str, Any]) -> "Selection":
    return codec.decode(cls, d, "selection")


@dataclasses.dataclass(frozen=True)
class Choice:
  """The checkpoint step export / evaluation take, and why.

  Attributes:
    step: the checkpoint step.
    which: what was asked ('best', 'latest' or the step number).
    reason: one sentence for the log and the summaries.
    metric, value: the validation metric and this step's score (None when not validated).
  """
  step: int
  which: str
  reason: str
  metric: str | None = None
  value: float | None = None

  JSON_STRICT = True  # (`codec`: unknown keys are refused)


def finished_steps(run_dir: str | Path) -> list[int]:
  """The finished checkpoint steps of a Stage 3 run directory, ascending."""
  root = Path(run_dir) / "checkpoints"
  return sorted(int(p.name) for p in root.glob("*") if p.name.isdigit() and (p / "state").exists())


def read_meta(run_dir: str | Path, step: int) -> dict[str, Any]:
  """Checkpoint ``step``'s JSON metadata (the trainer's `_meta`), read without orbax."""
  return json.loads((Path(run_dir) / "checkpoints" / str(step) / "meta" / "metadata").read_text())


def read_selection(run_dir: str | Path, step: int) -> Selection | None:
  """The validation record in checkpoint ``step``'s metadata (None if it holds none)."""
  meta = read_meta(run_dir, step)
  return Selection.from_json(meta["selection"]) if meta.get("selection") else None


def check_which(which: str, field: str) -> None:
  """Refuses a checkpoint choice other than 'best', 'latest' or a step number, naming ``field``."""
  if which not in ("best", "latest") and not str(which).isdigit():
    raise ValueError(f"{field} must be 'best', 'latest' or a checkpoint step number, got {which!r}")


def choose_step(run_dir: str | Path, which: str = "best") -> Choice:
  """The checkpoint of ``run_dir`` that ``which`` ('best' | 'latest' | a step number) names.

  'best' reads the validation record of the latest checkpoint; a run that never validated (no
  validation prompts, or validation off) has no best, and 'best' then takes the latest checkpoint,
  saying so in the reason.

  Raises:
    CheckpointUnreadableError: the chosen step's files differ from the checksums recorded when it
      was saved (`disa_jax.checkpoint.verify`); the error names the step and the file.
  """
  choice = _choose_step(run_dir, which)
  step_dir = Path(run_dir) / "checkpoints" / str(choice.step)
  why = verify.check(str(step_dir), deep=True)
  if why is not None:
    raise CheckpointUnreadableError(f"checkpoint step {choice.step} in {step_dir} ({choice.reason}) "
                                    f"is damaged: {why}; choose another step")
  return choice


def _choose_step(run_dir: str | Path, which: str) -> Choice:
  """`choose_step` before the chosen step's files are checked."""
  check_which(which, "checkpoint choice")
  steps = finished_steps(run_dir)
  if not steps:
    raise FileNotFoundError(f"no finished checkpoint under {Path(run_dir) / 'checkpoints'}")
  sel = read_selection(run_dir, steps[-1])
  score = lambda s: None if sel is None else dict(sel.scores).get(s)
  metric = None if sel is None else sel.metric
  if which == "latest":
    return Choice(steps[-1], which, f"the latest checkpoint (step {steps[-1]}), as asked",
                  metric, score(steps[-1]))
  if which != "best":
    step = int(which)
    if step not in steps:
      raise FileNotFoundError(f"checkpoint step {step} is not under {Path(run_dir) / 'checkpoints'} "
                              f"(finished steps: {steps})")
    return Choice(step, which, f"checkpoint step {step}, as asked", metric, score(step))
  if sel is None or sel.best is None:
    return Choice(steps[-1], which, f"no validation score was recorded (no validation prompts or "
                  f"validation off), so the latest checkpoint (step {steps[-1]})")
  step, value = sel.best
  if step not in steps:
    raise FileNotFoundError(f"the best checkpoint by {sel.metric} (step {step}, {value:.4f}) is "
                            f"missing under {Path(run_dir) / 'checkpoints'} (finished steps: "
                            f"{steps})")
  return Choice(step, which, f"the best of {len(sel.scores)} validations by {sel.metric} "
                f"({value:.4f} at step {step}; the latest, step {steps[-1]}, "
                f"{'has no score' if score(steps[-1]) is None else f'{score(steps[-1]):.4f}'})",
                sel.metric, value)
