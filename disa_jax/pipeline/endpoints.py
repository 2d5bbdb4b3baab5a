"""The pre-registered Stage 3 endpoints and their comparisons (issue 45, item 5).

On the on-policy sum scale an offset in log Z drops out of the end state (Prop. 3(ii)), so the
anchor can change only how a run gets there. The endpoints, declared before any run
(docs/preregistration.md), per run and per prompt set -- the training prompts (``exact/*`` in
metrics.jsonl) and the held-out ones (``exact_heldout/*``, `TrackConfig.heldout`):

- ``kl_auc``: the area under the ``kl_decomposed`` curve (trapezoids over the tracked steps)
  divided by the steps it spans: the run's mean KL to the target over training, in nats;
- ``kl_correct_end``: the conditional KL over the correct answers (``kl_correct``) at the last
  measurement;
- ``steps_to_p90``: the step where P(correct) first reaches 0.9, as interval-censored data
  (`censored.time_to_level`): between the last measurement below the level and the first at or
  above it; left-censored, in (0, first measured step], for a run already there at its first
  measurement; right-censored for one that never gets there. The table shows the step
  interpolated between the measurements on either side (`dynamics.matched_accuracy`), with the
  censored runs counted apart.

Each declared comparison ``A:B`` is, for ``kl_auc`` and ``kl_correct_end``, Welch's two-sided test
of mean(A) - mean(B) over seeds; for ``steps_to_p90``, Gehan's permutation test for
interval-censored data (`censored.gehan_test`; never a t-test over censored values), its effect
the share of cross pairs where A's run certainly got there first minus the share where B's did.
Holm's correction runs over every test of the family (all comparisons x endpoints x prompt sets
that were tested), and both p-values are reported. A cell's row gives the mean and its 95%
interval over seeds.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

import numpy as np

from disa_jax import codec
from disa_jax.pipeline import censored, dynamics, seed_stats
from disa_jax.pipeline.report_records import EndpointTest
from disa_jax.workflows.stage3 import ExactSeries, Stage3Run

ENDPOINTS = ("kl_auc", "kl_correct_end", "steps_to_p90")
PROMPT_SETS = {"train": "exact", "heldout": "exact_heldout"}  # set -> metrics prefix
P_LEVEL = 0.9
ALPHA = 0.05


@dataclasses.dataclass(frozen=True)
class EndpointsConfig:
  """``compare``: the declared comparisons, each 'A:B' (run names of ``methods``; A - B is
  tested, two-sided); () = no endpoint section.

  ``step_size``: a step-size pilot's runs (names of ``methods``, each with its own lr), () = none.
  Its rule (docs/preregistration.md, "The off-policy part"): a run is *stable* when, on the
  training prompts, its P(correct) is >= ``stable_level`` at the last measurement and never below
  ``stable_floor`` at any; the pilot picks the largest lr whose every seed is stable."""
  compare: tuple[str, ...] = ()
  step_size: tuple[str, ...] = ()
  stable_level: float = P_LEVEL
  stable_floor: float = 0.0

  def __post_init__(self):
    if not 0.0 <= self.stable_floor < self.stable_level <= 1.0:
      raise ValueError(f"endpoints needs 0 <= stable_floor < stable_level <= 1, got stable_floor="
                       f"{self.stable_floor!r}, stable_level={self.stable_level!r}")

  def pilot_runs(self, methods: Sequence[str]) -> tuple[str, ...]:
    """``step_size``, each run checked against ``methods``."""
    for i, name in enumerate(self.step_size):
      if name not in methods:
        raise ValueError(f"endpoints.step_size[{i}]={name!r} is not in methods {tuple(methods)}")
    if len(set(self.step_size)) != len(self.step_size):
      raise ValueError(f"endpoints.step_size names a run twice: {self.step_size!r}")
    return tuple(self.step_size)

  def pairs(self, methods: Sequence[str]) -> list[tuple[str, str]]:
    """The comparisons as (A, B), each run checked against ``methods``."""
    out = []
    for i, pair in enumerate(self.compare):
      a, sep, b = pair.partition(":")
      if not sep or not a or not b or a == b:
        raise ValueError(f"endpoints.compare[{i}] must be 'A:B' with two different runs, got "
                         f"{pair!r}")
      for name in (a, b):
        if name not in methods:
          raise ValueError(f"endpoints.compare[{i}]={pair!r}: {name!r} is not in methods "
                           f"{tuple(methods)}")
      out.append((a, b))
    return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunEndpoints:
  """The endpoints of one run on one prompt set (`run_endpoints`; not stored: the report keeps
  their summaries over seeds, `EndpointCell`, and the tests, `EndpointTest`).

  Attributes:
    kl_auc: the mean KL to the target over training, in nats (trapezoids over the tracked steps).
    kl_correct_end: the conditional KL over correct answers at the last measurement, in nats.
    steps_to_p90: the step where P(correct) first reaches the level, interpolated (the last step
      if never reached, the first if already there).
    censored: never reached the level (right-censored).
    left_censored: already there at a first measurement after step 0.
    p90_low, p90_high, p90_kind: the steps to the level as a `censored.Interval` (high None when
      never reached).
    measurements, first_step, last_step: the measurements it is computed from.
    seed: the run's Stage 3 seed (None: not given, `run_endpoints` alone).
  """
  kl_auc: float
  kl_correct_end: float
  steps_to_p90: float
  censored: bool
  left_censored: bool
  p90_low: float
  p90_high: float | None
  p90_kind: str
  measurements: int
  first_step: int
  last_step: int
  seed: int | None = None

  def value(self, endpoint: str) -> float:
    """The endpoint named ``endpoint`` (one of `ENDPOINTS`)."""
    return float(getattr(self, endpoint))

  def interval(self) -> censored.Interval:
    """Its steps to the level as a `censored.Interval`."""
    return censored.Interval(low=self.p90_low, kind=self.p90_kind,
                             high=float("inf") if self.p90_high is None else self.p90_high)


def run_endpoints(series: ExactSeries, level: float = P_LEVEL) -> RunEndpoints:
  """The endpoints of one run's measurements on one prompt set.

  Args:
    series: its exact measures (>= 2 measurements).
    level: the P(correct) level of ``steps_to_p90``.
  """
  step = np.asarray(series["step"], np.float64)
  if step.size < 2 or np.any(np.diff(step) <= 0):
    raise ValueError(f"run_endpoints needs >= 2 measurements at increasing steps, got steps "
                     f"{np.asarray(series['step']).tolist()}")
  kl = np.asarray(series["kl_decomposed"], np.float64)
  auc = float(np.sum((kl[1:] + kl[:-1]) / 2.0 * np.diff(step)) / (step[-1] - step[0]))
  crossing = dynamics.matched_accuracy(series, (level,))[f"{level:g}"]  # the interpolated step
  reach = float(step[-1]) if crossing is None else crossing.step
  when = censored.time_to_level(step, series["p_correct"], level)
  return RunEndpoints(kl_auc=auc, kl_correct_end=float(series["kl_correct"][-1]),
                      steps_to_p90=reach, censored=when.kind == "right",
                      left_censored=when.kind == "left", p90_low=when.low,
                      p90_high=None if when.kind == "right" else when.high, p90_kind=when.kind,
                      measurements=int(step.size), first_step=int(step[0]),
                      last_step=int(step[-1]))


PerRun = Mapping[str, Mapping[str, Sequence[RunEndpoints]]]  # prompt set -> run -> its seeds'


def collect(stage3: Mapping[tuple[str, int], Stage3Run], run_seeds: Mapping[str, Sequence[int]]
            ) -> dict[str, dict[str, list[RunEndpoints]]]:
  """Prompt set -> run -> its seeds' `run_endpoints`, from each finished run's metrics.

  Args:
    stage3: (run, seed) -> `Stage3Run` (the job's runs; a missing one is left out).
    run_seeds: run -> its Stage 3 seeds (the runs of the section).

  A prompt set no run measured (no held-out tracking) is left out; a run with fewer than 2
  measurements of a set has no endpoints there.
  """
  out: dict[str, dict[str, list[RunEndpoints]]] = {}
  for ps, prefix in PROMPT_SETS.items():
    for name, seeds in run_seeds.items():
      for seed in seeds:
        run = stage3.get((name, seed))
        if run is None or not run.metrics_path.exists():
          continue
        series = run.exact_series(prefix)
        if series["step"].size >= 2:
          ends = dataclasses.replace(run_endpoints(series), seed=seed)
          out.setdefault(ps, {}).setdefault(name, []).append(ends)
  return out


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
class StepSizeSection:
  """The report's ``step_size`` section (`step_size_section`): one row per (run, seed), the
  largest lr whose every seed is stable (``chosen``, run ``chosen_run``; None: none is, or a run
  is missing), the rule's ``level`` and ``floor`` (P(correct)) and the ``verdict`` in words."""
  runs: tuple[StepSizeRow, ...]
  chosen: float | None
  chosen_run: str | None
  level: float
  floor: float
  verdict: str


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
  best = max(stable_lrs, key=stable_lrs.get) if stable_lrs and not missing else None
  if missing:
    verdict = "undecided: not measured: " + ", ".join(missing)
  elif best is None:
    verdict = f"no lr is stable (P(correct) >= {level:g} at the end, never below {floor:g})"
  else:
    verdict = f"lr {stable_lrs[best]:g} ({best}): the largest stable"
  return StepSizeSection(runs=tuple(rows), chosen=None if best is None else stable_lrs[best],
                         chosen_run=best, level=level, floor=floor, verdict=verdict)


def step_size_markdown(sec: StepSizeSection) -> list[str]:
  """The step-size pilot's table of report.md."""
  out = ["## Step-size pilot (docs/preregistration.md)", "",
         f"Stable: training P(correct) >= {sec.level:g} at the last measurement and never below "
         f"{sec.floor:g}. **{sec.verdict}**.", "",
         "| run | seed | lr | P(correct) last | min (step) | stable |", "|---|--:|--:|--:|--:|---|"]
  for r in sec.runs:
    if r.missing:
      out.append(f"| `{r.run}` | {r.seed} | {r.lr:g} | - | - | not measured |")
    else:
      out.append(f"| `{r.run}` | {r.seed} | {r.lr:g} | {r.p_last:.3f} | "
                 f"{r.p_min:.3f} ({r.p_min_step}) | {'yes' if r.stable else 'no'} |")
  return out + [""]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Summary:
  """An endpoint over a cell's seeds: the ``mean`` and its 95% interval (``ci_low``, ``ci_high``;
  None for a lone seed; the value itself when every seed has the same value)."""
  mean: float
  ci_low: float | None
  ci_high: float | None

  def __str__(self) -> str:
    if self.ci_low is None:
      return f"{self.mean:.3f}"
    return f"{self.mean:.3f} [{self.ci_low:.3f}, {self.ci_high:.3f}]"


@dataclasses.dataclass(frozen=True, kw_only=True)
class EndpointCell:
  """One run's row of a prompt set (`_cell`): its ``seeds``, how many never reached the level
  (``censored``) and were already past it (``left_censored``; None in a report from before issue
  62), and each endpoint's `Summary` (KLs in nats, steps in RL steps)."""
  seeds: int
  censored: int
  left_censored: int | None = codec.field(default=None, omit=None)
  kl_auc: Summary
  kl_correct_end: Summary
  steps_to_p90: Summary

  def summary(self, endpoint: str) -> Summary:
    return getattr(self, endpoint)


def _cell(rows: Sequence[RunEndpoints]) -> EndpointCell:
  """Per endpoint: mean and 95% interval over the seeds' values (n >= 2), or the lone value."""
  out = {}
  for e in ENDPOINTS:
    x = [r.value(e) for r in rows]
    if len(x) >= 2 and len(set(x)) > 1:
      s = seed_stats.one_sample(x)
      out[e] = Summary(mean=s.mean, ci_low=s.ci_low, ci_high=s.ci_high)
    elif len(x) >= 2:  # every seed the same value (e.g. all censored at the last step)
      out[e] = Summary(mean=x[0], ci_low=x[0], ci_high=x[0])
    else:
      out[e] = Summary(mean=x[0] if x else float("nan"), ci_low=None, ci_high=None)
  return EndpointCell(seeds=len(rows), censored=int(sum(bool(r.censored) for r in rows)),
                      left_censored=int(sum(bool(r.left_censored) for r in rows)), **out)


@dataclasses.dataclass(frozen=True, kw_only=True)
class EndpointsSection:
  """The report's ``endpoints`` section (`section`): per prompt set ('train' | 'heldout') and run
  its `EndpointCell`, the declared `EndpointTest`s, the number of tests Holm corrects over
  (``family``), ``alpha``, the ``endpoints`` and the P(correct) level of ``steps_to_p90``."""
  cells: Mapping[str, Mapping[str, EndpointCell]]
  tests: tuple[EndpointTest, ...]
  family: int
  alpha: float
  endpoints: tuple[str, ...]
  p_level: float


def section(per_run: PerRun, pairs: Sequence[tuple[str, str]]) -> EndpointsSection:
  """The report's ``endpoints`` section.

  Args:
    per_run: prompt set ('train' | 'heldout') -> run name -> its seeds' `run_endpoints`.
    pairs: the declared comparisons (A, B).
  """
  cells = {ps: {name: _cell(rows) for name, rows in runs.items()} for ps, runs in per_run.items()}
  tests = [_test(runs.get(a, ()), runs.get(b, ()), a, b, e, ps)
           for ps, runs in per_run.items() for a, b in pairs for e in ENDPOINTS]
  tested = [i for i, t in enumerate(tests) if t.p is not None]
  adjusted = seed_stats.holm([tests[i].p for i in tested]) if tested else []
  for i, q in zip(tested, adjusted):
    t = tests[i]
    lower, higher = ("A earlier", "A later") if t.method == "gehan" else ("A lower", "A higher")
    tests[i] = dataclasses.replace(t, p_holm=float(q), verdict=(
        (lower if t.diff < 0 else higher) if q < ALPHA else
        f"undecided (Holm p = {q:.3g} >= {ALPHA:g})"))
  return EndpointsSection(cells=cells, tests=tuple(tests), family=len(tested), alpha=ALPHA,
                          endpoints=ENDPOINTS, p_level=P_LEVEL)


def _test(ra: Sequence[RunEndpoints], rb: Sequence[RunEndpoints], a: str, b: str,
          endpoint: str, prompt_set: str) -> EndpointTest:
  """One declared test: Welch over seeds (Gehan's for ``steps_to_p90``), or why it was not run."""
  row = EndpointTest(a=a, b=b, endpoint=endpoint, set=prompt_set, n_a=len(ra), n_b=len(rb),
                     method="gehan" if endpoint == "steps_to_p90" else "welch")
  if len(ra) < 2 or len(rb) < 2:
    return dataclasses.replace(
        row, verdict=f"undecided ({len(ra)} / {len(rb)} seeds (a test needs >= 2 a side))")
  if endpoint == "steps_to_p90":
    g = censored.gehan_test([r.interval() for r in ra], [r.interval() for r in rb])
    # diff < 0: A got there first (earlier), as for a difference of steps
    return dataclasses.replace(row, p=g.p, diff=-g.effect, kinds=tuple(g.kinds), splits=g.splits)
  try:
    c = seed_stats.welch([r.value(endpoint) for r in ra], [r.value(endpoint) for r in rb])
  except ValueError as e:  # constant on both sides: no test
    return dataclasses.replace(row, verdict=f"undecided ({e})")
  return dataclasses.replace(row, p=c.p, diff=c.diff, ci_low=c.ci_low, ci_high=c.ci_high)


def markdown(sec: EndpointsSection) -> list[str]:
  """The endpoint tables of report.md (a section from before issue 62, with Welch on every
  endpoint, in its own words)."""
  gehan = any(t.method == "gehan" for t in sec.tests)
  tests = ("Welch on kl_auc and kl_correct_end, Gehan's permutation test for interval-censored "
           "data on steps_to_p90 (diff: minus its effect, the share of cross pairs where A's run "
           "certainly got there first minus B's), two-sided" if gehan else "Welch, two-sided")
  out = ["## Pre-registered endpoints (docs/preregistration.md)", "",
         f"Means over seeds with 95% intervals; `steps_to_p90` is the step where P(correct) first "
         f"reaches {sec.p_level:g} (censored runs counted apart). Tests: {tests}, Holm over the "
         f"{sec.family} tests run.", ""]
  left = any(c.left_censored is not None for cells in sec.cells.values() for c in cells.values())
  for ps, cells in sec.cells.items():
    out += [f"### {ps} prompts", "", "| run | seeds | " + " | ".join(sec.endpoints)
            + (" | never reached / already past |" if left else " | censored |"),
            "|---|--:|" + "--:|" * len(sec.endpoints) + "--:|"]
    for name, c in cells.items():
      vals = [str(c.summary(e)) for e in sec.endpoints]
      cens = f"{c.censored} / {c.left_censored}" if left else f"{c.censored}"
      out.append(f"| `{name}` | {c.seeds} | " + " | ".join(vals) + f" | {cens} |")
    out.append("")
  out += ["| A - B | set | endpoint | diff [95% CI] | p | Holm p | verdict |",
          "|---|---|---|--:|--:|--:|---|"]
  for t in sec.tests:
    if t.diff is None:
      diff = "-"
    elif t.method == "gehan":
      diff = f"{t.diff:+.3f} (Gehan)"
    else:
      diff = f"{t.diff:+.3f} [{t.ci_low:+.3f}, {t.ci_high:+.3f}]"
    p = "-" if t.p is None else f"{t.p:.3g}"
    q = "-" if t.p_holm is None else f"{t.p_holm:.3g}"
    out.append(f"| `{t.a}` - `{t.b}` | {t.set} | {t.endpoint} | {diff} | {p} | {q} "
               f"| {t.verdict} |")
  return out + [""]
