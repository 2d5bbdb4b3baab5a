"""A step-size pilot's rule (docs/preregistration.md, "The off-policy part"; issue 63's pilot): a
run is *stable* when, on the training prompts, its P(correct) is >= the level at the last
measurement and never below the floor; the pilot picks the largest lr whose every seed is stable,
per group of runs '<group>_lr<tag>' (`pilot_group`; a pilot of untagged runs is one group). A group
may be run from its largest lr down: a missing run matters only above the largest stable lr.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Mapping, Sequence

import numpy as np

from disa_jax import codec
from disa_jax.pipeline.endpoints import EndpointsConfig
from disa_jax.workflows.stage3 import ExactSeries, Stage3Run

LR_TAG = re.compile(r"(.*?)_?lr[0-9]+(?:em?[0-9]+)?")  # pilot runs '<group>_lr<tag>': per group


@dataclasses.dataclass(frozen=True, kw_only=True)
class Stability:
  """The step-size rule on one run's training-prompt measurements (`stability`): ``stable``;
  P(correct) at the last measurement (``p_last``) and its lowest (``p_min``, at step
  ``p_min_step``); ``last_step`` and the number of ``measurements``."""
  stable: bool
  p_last: float
  p_min: float
  p_min_step: int
  last_step: int
  measurements: int


def stability(series: ExactSeries, level: float, floor: float) -> Stability:
  """The step-size rule on one run's training-prompt measurements (`EndpointsConfig`): stable
  when P(correct) is >= ``level`` at the last measurement and >= ``floor`` at every one."""
  p = np.asarray(series["p_correct"], np.float64)
  if p.size == 0:
    raise ValueError("stability needs >= 1 measurement of P(correct), got none")
  low = int(np.argmin(p))
  return Stability(stable=bool(p[-1] >= level and p[low] >= floor), p_last=float(p[-1]),
                   p_min=float(p[low]), p_min_step=int(series["step"][low]),
                   last_step=int(series["step"][-1]), measurements=int(p.size))


def _unset():
  """A field of `Stability` in a `StepSizeRow`: None (and not stored) for a missing run."""
  return codec.field(default=None, omit=None)


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepSizeRow:
  """One (run, seed) of the step-size pilot: its peak ``lr``, whether it is ``missing`` (not
  measured), and else its `Stability` (the fields of the same names; None for a missing run)."""
  run: str
  seed: int
  lr: float
  missing: bool
  stable: bool | None = _unset()
  p_last: float | None = _unset()
  p_min: float | None = _unset()
  p_min_step: int | None = _unset()
  last_step: int | None = _unset()
  measurements: int | None = _unset()


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepSizePick:
  """One group's choice (`_pick`): the largest stable lr (``chosen``, run ``chosen_run``; None:
  none is, or a larger lr is not measured) and the ``verdict`` in words."""
  chosen: float | None
  chosen_run: str | None
  verdict: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepSizeSection:
  """The report's ``step_size`` section (`step_size_section`): one row per (run, seed), the
  largest lr whose every seed is stable (``chosen``, run ``chosen_run``; None: none is, or a run
  is missing), the rule's ``level`` and ``floor`` (P(correct)) and the ``verdict`` in words; with
  runs of several groups ('<group>_lr<tag>', issue 63) each group's `StepSizePick` (``groups``;
  ``chosen`` None)."""
  runs: tuple[StepSizeRow, ...]
  chosen: float | None
  chosen_run: str | None
  level: float
  floor: float
  verdict: str
  groups: Mapping[str, StepSizePick] | None = codec.field(default=None, omit=None)


def step_size_section(stage3: Mapping[tuple[str, int], Stage3Run],
                      runs: Mapping[str, tuple[float, Sequence[int]]],
                      rule: EndpointsConfig) -> StepSizeSection:
  """The report's ``step_size`` section: the pilot's rule on each run and the lr it picks.

  Args:
    stage3: (run, seed) -> `Stage3Run` (a missing run or one without measurements: not decided).
    runs: the pilot's runs, name -> (its peak lr, its seeds).
    rule: its ``stable_level`` and ``stable_floor``.
  """
  level, floor = rule.stable_level, rule.stable_floor
  rows, stable_lrs, missing = [], {}, []
  for name, (lr, seeds) in runs.items():
    ok = True
    for seed in seeds:
      run = stage3.get((name, seed))
      series = None if run is None or not run.metrics_path.exists() else run.exact_series("exact")
      if series is None or series["step"].size == 0:
        rows.append(StepSizeRow(run=name, seed=seed, lr=lr, missing=True))
        missing.append(f"{name} (seed {seed})")
        ok = False
        continue
      row = stability(series, level, floor)
      rows.append(StepSizeRow(run=name, seed=seed, lr=lr, missing=False, **dataclasses.asdict(row)))
      ok = ok and row.stable
    if ok:
      stable_lrs[name] = lr
  groups: dict[str, list[str]] = {}
  for name in runs:
    groups.setdefault(pilot_group(name), []).append(name)
  lrs = {name: lr for name, (lr, _) in runs.items()}
  picks = {g: _pick(names, lrs, stable_lrs, missing, level, floor) for g, names in groups.items()}
  one = next(iter(picks.values())) if len(picks) == 1 else StepSizePick(
      chosen=None, chosen_run=None,
      verdict=f"{sum(p.chosen is not None for p in picks.values())} of {len(picks)} groups have a "
              f"stable lr")
  return StepSizeSection(runs=tuple(rows), chosen=one.chosen, chosen_run=one.chosen_run,
                         level=level, floor=floor, verdict=one.verdict,
                         groups=picks if len(picks) > 1 else None)


def pilot_group(name: str) -> str:
  """The group of pilot run ``name``: 'disa_c1_lr3em4' -> 'disa_c1'; 'lr3em4' and a name without
  an lr tag -> '' (one group: a pilot of one choice, as before issue 63)."""
  m = LR_TAG.fullmatch(name)
  return m.group(1) if m else ""


def _pick(names: Sequence[str], lrs: Mapping[str, float], stable_lrs: Mapping[str, float],
          missing: Sequence[str], level: float, floor: float) -> StepSizePick:
  """The largest stable lr of one group's runs ``names``, or why there is none. A run not measured
  matters only at an lr above the largest stable one (the pilot may run a group from its largest
  lr down and stop at the first stable one)."""
  ok = {n: stable_lrs[n] for n in names if n in stable_lrs}
  top = max(ok.values()) if ok else -1.0
  lost = [m for m in missing if m.split(" (seed")[0] in names and lrs[m.split(" (seed")[0]] > top]
  best = max(ok, key=ok.get) if ok and not lost else None
  if lost:
    verdict = "undecided: not measured: " + ", ".join(lost)
  elif best is None:
    verdict = f"no lr is stable (P(correct) >= {level:g} at the end, never below {floor:g})"
  else:
    verdict = f"lr {ok[best]:g} ({best}): the largest stable"
  return StepSizePick(chosen=None if best is None else ok[best], chosen_run=best, verdict=verdict)


def step_size_markdown(sec: StepSizeSection) -> list[str]:
  """The step-size pilot's table of report.md (each group's choice first, with several)."""
  out = ["## Step-size pilot (docs/preregistration.md)", "",
         f"Stable: training P(correct) >= {sec.level:g} at the last measurement and never below "
         f"{sec.floor:g}. **{sec.verdict}**.", ""]
  if sec.groups:
    out += ["| group | chosen lr | verdict |", "|---|--:|---|"]
    out += [f"| `{g}` | {'-' if p.chosen is None else format(p.chosen, 'g')} | {p.verdict} |"
            for g, p in sec.groups.items()] + [""]
  out += ["| run | seed | lr | P(correct) last | min (step) | stable |", "|---|--:|--:|--:|--:|---|"]
  for r in sec.runs:
    if r.missing:
      out.append(f"| `{r.run}` | {r.seed} | {r.lr:g} | - | - | not measured |")
    else:
      out.append(f"| `{r.run}` | {r.seed} | {r.lr:g} | {r.p_last:.3f} | "
                 f"{r.p_min:.3f} ({r.p_min_step}) | {'yes' if r.stable else 'no'} |")
  return out + [""]
