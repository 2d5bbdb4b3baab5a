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

Issue 63 adds, where a preset declares them (`EndpointsConfig`): the endpoint ``kl_end`` (the mean
``kl_decomposed`` over the end-state window, the last `END_WINDOW` of the measured steps); the
anchor replica as the unit of a cell run on several Stage 1-2 replicas (a replica's mean over its
seeds; its steps-to-level interval the mean of its seeds' bounds); equivalence tests (TOST,
`seed_stats.WelchResult.tost_p`, against declared margins on the training prompts, a Holm family
of their own); and the step's own logs per run (`step_logs`). The step-size pilots' rule is
`disa_jax.pipeline.step_size`.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

import numpy as np

from disa_jax import codec
from disa_jax.pipeline import censored, dynamics, seed_stats
from disa_jax.pipeline import readings as RD
from disa_jax.pipeline.report_records import EndpointTest, split_comparison
from disa_jax.workflows.stage3 import ExactSeries, Stage3Run

ENDPOINTS = ("kl_auc", "kl_correct_end", "steps_to_p90")
KNOWN_ENDPOINTS = (*ENDPOINTS, "kl_end")
END_WINDOW = 0.25  # kl_end: the last quarter of the measured steps (the end-state rule's window)
# The step's own logs summarised per run (issue 62 item 6; logged, not tested): E[delta] (the mean
# TB residual: the baseline the log Z provides), the pre-clip gradient norm, the clipped share.
STEP_LOGS = ("tb_residual_mean", "grad_norm", "grad_clipped_share")
PROMPT_SETS = {"train": "exact", "heldout": "exact_heldout"}  # set -> metrics prefix
P_LEVEL = 0.9
ALPHA = 0.05


@dataclasses.dataclass(frozen=True, kw_only=True)
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
  # The endpoints tested (of KNOWN_ENDPOINTS), and the equivalence tests: 'A:B' pairs, each TOST on
  # the training prompts for every endpoint of ``margins`` (endpoint -> margin > 0, in its units).
  endpoints: tuple[str, ...] = ENDPOINTS
  equivalence: tuple[str, ...] = ()
  margins: dict[str, float] = dataclasses.field(default_factory=dict)
  # The clip arms whose declared readings the report makes (`pipeline.readings`; () = none).
  readings: tuple[str, ...] = ()

  def __post_init__(self):
    if not 0.0 <= self.stable_floor < self.stable_level <= 1.0:
      raise ValueError(f"endpoints needs 0 <= stable_floor < stable_level <= 1, got stable_floor="
                       f"{self.stable_floor!r}, stable_level={self.stable_level!r}")
    for e in self.endpoints:
      if e not in KNOWN_ENDPOINTS:
        raise ValueError(f"endpoints.endpoints: {e!r} is not one of {KNOWN_ENDPOINTS}")
    for e, m in self.margins.items():
      if e not in self.endpoints or e == "steps_to_p90" or not m > 0:
        raise ValueError(f"endpoints.margins[{e!r}]={m!r}: needs an uncensored endpoint of "
                         f"endpoints.endpoints {self.endpoints} and a margin > 0")
    if self.equivalence and not self.margins:
      raise ValueError(f"endpoints.equivalence={self.equivalence!r} needs endpoints.margins")

  def equivalence_pairs(self, methods: Sequence[str]) -> list[tuple[str, str]]:
    """The equivalence comparisons as (A, B), each run checked against ``methods``."""
    return _split_pairs(self.equivalence, methods, "equivalence")

  def pilot_runs(self, methods: Sequence[str]) -> tuple[str, ...]:
    """``step_size``, each run checked against ``methods``."""
    for i, name in enumerate(self.step_size):
      if name not in methods:
        raise ValueError(f"endpoints.step_size[{i}]={name!r} is not in methods {tuple(methods)}")
    if len(set(self.step_size)) != len(self.step_size):
      raise ValueError(f"endpoints.step_size names a run twice: {self.step_size!r}")
    return tuple(self.step_size)

  def reading_arms(self, methods: Sequence[str]) -> tuple[str, ...]:
    """``readings``, each arm's runs (`readings.arm_runs`) checked against ``methods`` and its
    tests against ``compare``."""
    declared = set(self.compare)
    for arm in self.readings:
      runs = RD.arm_runs(arm)
      need = [f"{a}_{arm}:{b}_{arm}" for a, b in RD.PAIRS]
      missing = [r for r in runs if r not in methods] + [p for p in need if p not in declared]
      if missing:
        raise ValueError(f"endpoints.readings arm {arm!r} needs the runs {runs} and the "
                         f"comparisons {need}; missing {missing}")
    return tuple(self.readings)

  def pairs(self, methods: Sequence[str]) -> list[tuple[str, str]]:
    """The comparisons as (A, B), each run checked against ``methods``."""
    return _split_pairs(self.compare, methods, "compare")


def _split_pairs(pairs: Sequence[str], methods: Sequence[str], field: str
                 ) -> list[tuple[str, str]]:
  out = []
  for i, pair in enumerate(pairs):
    split = split_comparison(pair)
    if split is None:
      raise ValueError(f"endpoints.{field}[{i}] must be 'A:B' with two different runs, got "
                       f"{pair!r}")
    for name in split:
      if name not in methods:
        raise ValueError(f"endpoints.{field}[{i}]={pair!r}: {name!r} is not in methods "
                         f"{tuple(methods)}")
    out.append(split)
  return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunEndpoints:
  """The endpoints of one run on one prompt set (`run_endpoints`; not stored: the report keeps
  their summaries over seeds, `EndpointCell`, and the tests, `EndpointTest`).

  Attributes:
    kl_auc: the mean KL to the target over training, in nats (trapezoids over the tracked steps).
    kl_correct_end: the conditional KL over correct answers at the last measurement, in nats.
    kl_end: the mean KL to the target over the last `END_WINDOW` of the measured steps, in nats.
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
  kl_end: float | None = None  # (issue 63; None where a caller built the record without it)

  def value(self, endpoint: str) -> float:
    """The endpoint named ``endpoint`` (one of `KNOWN_ENDPOINTS`)."""
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
  window = step >= step[-1] - END_WINDOW * (step[-1] - step[0])
  return RunEndpoints(kl_auc=auc, kl_correct_end=float(series["kl_correct"][-1]),
                      kl_end=float(kl[window].mean()),
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
  kl_auc: Summary | None = codec.field(default=None, omit=None)
  kl_correct_end: Summary | None = codec.field(default=None, omit=None)
  steps_to_p90: Summary | None = codec.field(default=None, omit=None)
  kl_end: Summary | None = codec.field(default=None, omit=None)  # (issue 63's presets)

  def summary(self, endpoint: str) -> Summary:
    return getattr(self, endpoint)


def _cell(rows: Sequence[RunEndpoints], endpoints: Sequence[str] = ENDPOINTS) -> EndpointCell:
  """Per endpoint: mean and 95% interval over the seeds' values (n >= 2), or the lone value."""
  out = {e: _summary([r.value(e) for r in rows]) for e in endpoints}
  return EndpointCell(seeds=len(rows), censored=int(sum(bool(r.censored) for r in rows)),
                      left_censored=int(sum(bool(r.left_censored) for r in rows)), **out)


def _summary(x: Sequence[float]) -> Summary:
  """The mean and 95% interval over seeds' values (n >= 2), or the lone value."""
  if len(x) >= 2 and len(set(x)) > 1:
    s = seed_stats.one_sample(x)
    return Summary(mean=s.mean, ci_low=s.ci_low, ci_high=s.ci_high)
  if len(x) >= 2:  # every seed the same value (e.g. all censored at the last step)
    return Summary(mean=x[0], ci_low=x[0], ci_high=x[0])
  return Summary(mean=x[0] if x else float("nan"), ci_low=None, ci_high=None)


def replica_unit(rows: Sequence[RunEndpoints]) -> RunEndpoints:
  """One anchor replica's unit from its seeds' `run_endpoints`: each endpoint's mean; the steps to
  the level as the interval of the mean (the mean of the lower bounds, of the upper bounds)."""
  if not rows:
    raise ValueError("replica_unit needs >= 1 run of the replica, got none")
  kinds = {r.p90_kind for r in rows}
  low = float(np.mean([r.p90_low for r in rows]))
  kind = ("exact" if kinds == {"exact"} else "right" if "right" in kinds else
          "left" if low == 0 else "interval")
  mean = lambda f: float(np.mean([getattr(r, f) for r in rows]))
  return RunEndpoints(
      kl_auc=mean("kl_auc"), kl_correct_end=mean("kl_correct_end"),
      kl_end=None if any(r.kl_end is None for r in rows) else mean("kl_end"),
      steps_to_p90=mean("steps_to_p90"), censored=kind == "right", left_censored=kind == "left",
      p90_low=low, p90_high=None if kind == "right" else mean("p90_high"), p90_kind=kind,
      measurements=min(r.measurements for r in rows), first_step=min(r.first_step for r in rows),
      last_step=max(r.last_step for r in rows))


def units(runs: Mapping[str, Sequence[RunEndpoints]], name: str,
          replicas: Mapping[str, Sequence[str]]) -> list[RunEndpoints]:
  """A cell's analysis units on one prompt set: its seeds, or (a cell run on several anchor
  replicas, `MainConfig.anchor_replicas`) each replica's `replica_unit`."""
  if name not in replicas:
    return list(runs.get(name, ()))
  return [replica_unit(runs[r]) for r in replicas[name] if runs.get(r)]


@dataclasses.dataclass(frozen=True, kw_only=True)
class EquivalenceTest:
  """One declared equivalence test (TOST of |mean(A) - mean(B)| < ``margin`` on ``endpoint``):
  the difference and its 90% interval, the TOST p-value (the larger one-sided p), its Holm
  p-value within the equivalence family, the units a side and the verdict."""
  a: str
  b: str
  endpoint: str
  margin: float
  p: float | None = None
  p_holm: float | None = None
  diff: float | None = None
  ci90_low: float | None = None
  ci90_high: float | None = None
  n_a: int
  n_b: int
  verdict: str = ""


@dataclasses.dataclass(frozen=True, kw_only=True)
class EquivalenceSection:
  """The equivalence tests on prompt set ``set``, Holm over the ``family`` of those run."""
  tests: tuple[EquivalenceTest, ...]
  family: int
  alpha: float
  set: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepLogCell:
  """A run's training logs over its ``seeds`` (`step_logs`): per `STEP_LOGS` key the mean over
  seeds (95% interval) of each seed's mean over the steps that logged it (None: never logged)."""
  seeds: int
  tb_residual_mean: Summary | None = codec.field(default=None, omit=None)
  grad_norm: Summary | None = codec.field(default=None, omit=None)
  grad_clipped_share: Summary | None = codec.field(default=None, omit=None)


@dataclasses.dataclass(frozen=True, kw_only=True)
class EndpointsSection:
  """The report's ``endpoints`` section (`section`): per prompt set ('train' | 'heldout') and run
  its `EndpointCell`, the declared `EndpointTest`s, the number of tests Holm corrects over
  (``family``), ``alpha``, the ``endpoints`` and the P(correct) level of ``steps_to_p90``; where a
  preset declares them (issue 63), the replicated cells over their replica units
  (``replica_cells``), the `EquivalenceSection` and each run's `StepLogCell` (``step_logs``)."""
  cells: Mapping[str, Mapping[str, EndpointCell]]
  tests: tuple[EndpointTest, ...]
  family: int
  alpha: float
  endpoints: tuple[str, ...]
  p_level: float
  replica_cells: Mapping[str, Mapping[str, EndpointCell]] | None = codec.field(default=None,
                                                                                omit=None)
  equivalence: EquivalenceSection | None = codec.field(default=None, omit=None)
  step_logs: Mapping[str, StepLogCell] | None = codec.field(default=None, omit=None)
  readings: RD.Readings | None = codec.field(default=None, omit=None)


def section(per_run: PerRun, pairs: Sequence[tuple[str, str]], *,
            rule: EndpointsConfig | None = None,
            replicas: Mapping[str, Sequence[str]] | None = None,
            equivalence: Sequence[tuple[str, str]] = ()) -> EndpointsSection:
  """The report's ``endpoints`` section.

  Args:
    per_run: prompt set ('train' | 'heldout') -> run name -> its seeds' `run_endpoints`.
    pairs: the declared comparisons (A, B).
    rule: the preset's endpoints section (its ``endpoints`` and ``margins``; None: the default).
    replicas: cell -> its run on each anchor replica (a cell named here is tested over replica
      units, `units`; {} / None: every cell over seeds).
    equivalence: the declared equivalence comparisons (A, B) (TOST on the training prompts).
  """
  rule, replicas = rule or EndpointsConfig(), dict(replicas or {})
  ends = tuple(rule.endpoints)
  cells = {ps: {name: _cell(rows, ends) for name, rows in runs.items()}
           for ps, runs in per_run.items()}
  tests = [_test(units(runs, a, replicas), units(runs, b, replicas), a, b, e, ps)
           for ps, runs in per_run.items() for a, b in pairs for e in ends]
  tested = [i for i, t in enumerate(tests) if t.p is not None]
  adjusted = seed_stats.holm([tests[i].p for i in tested]) if tested else []
  for i, q in zip(tested, adjusted):
    t = tests[i]
    lower, higher = ("A earlier", "A later") if t.method == "gehan" else ("A lower", "A higher")
    tests[i] = dataclasses.replace(t, p_holm=float(q), verdict=(
        (lower if t.diff < 0 else higher) if q < ALPHA else
        f"undecided (Holm p = {q:.3g} >= {ALPHA:g})"))
  reps = ({ps: {c: _cell(units(runs, c, replicas), ends) for c in replicas}
           for ps, runs in per_run.items()} if replicas else None)
  eq = (equivalence_tests(per_run.get("train", {}), equivalence, rule.margins, replicas)
        if equivalence else None)
  return EndpointsSection(cells=cells, tests=tuple(tests), family=len(tested), alpha=ALPHA,
                          endpoints=ends, p_level=P_LEVEL, replica_cells=reps, equivalence=eq)


def equivalence_tests(runs: Mapping[str, Sequence[RunEndpoints]],
                      pairs: Sequence[tuple[str, str]], margins: Mapping[str, float],
                      replicas: Mapping[str, Sequence[str]]) -> EquivalenceSection:
  """TOST of |mean(A) - mean(B)| < margin per pair and margin's endpoint on the training prompts'
  units, Holm over the tests run (a family of its own)."""
  tests = []
  for a, b in pairs:
    ua, ub = units(runs, a, replicas), units(runs, b, replicas)
    for e, m in margins.items():
      row = EquivalenceTest(a=a, b=b, endpoint=e, margin=float(m), n_a=len(ua), n_b=len(ub))
      try:
        w = seed_stats.welch([u.value(e) for u in ua], [u.value(e) for u in ub], level=0.9)
      except ValueError as err:  # < 2 units a side, or constant on both
        row = dataclasses.replace(row, verdict=f"not tested ({err})")
      else:
        row = dataclasses.replace(row, p=float(w.tost_p(m)), diff=w.diff, ci90_low=w.ci_low,
                                  ci90_high=w.ci_high)
      tests.append(row)
  tested = [i for i, t in enumerate(tests) if t.p is not None]
  for i, q in zip(tested, seed_stats.holm([tests[i].p for i in tested]) if tested else []):
    t = tests[i]
    tests[i] = dataclasses.replace(t, p_holm=float(q), verdict=(
        f"shown equivalent within +-{t.margin:g}" if q < ALPHA else
        f"equivalence not shown (Holm p = {q:.3g})"))
  return EquivalenceSection(tests=tuple(tests), family=len(tested), alpha=ALPHA, set="train")


def step_logs(stage3: Mapping[tuple[str, int], Stage3Run],
              run_seeds: Mapping[str, Sequence[int]]) -> dict[str, StepLogCell]:
  """Run -> its `StepLogCell` from each finished seed's metrics (a run without any logged row is
  left out)."""
  out = {}
  for name, seeds in run_seeds.items():
    per_seed = []
    for seed in seeds:
      run = stage3.get((name, seed))
      if run is None or not run.metrics_path.exists():
        continue
      rows = run.metrics()
      means = {k: float(np.mean([r[k] for r in rows if k in r])) for k in STEP_LOGS
               if any(k in r for r in rows)}
      if means:
        per_seed.append(means)
    keys = [k for k in STEP_LOGS if per_seed and all(k in m for m in per_seed)]
    if keys:
      out[name] = StepLogCell(seeds=len(per_seed), **{k: _summary([m[k] for m in per_seed])
                                                      for k in keys})
  return out


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
  return (out + [""] + RD.markdown(sec.readings) + _replica_markdown(sec)
          + _equivalence_markdown(sec.equivalence) + _step_logs_markdown(sec.step_logs))


def _replica_markdown(sec: EndpointsSection) -> list[str]:
  """The cells run on several anchor replicas, over their replica units (what the tests read)."""
  if not sec.replica_cells:
    return []
  out = ["### Cells over anchor replicas (the tests' units: a replica's mean over its seeds)", "",
         "| cell | set | replicas | " + " | ".join(sec.endpoints) + " |",
         "|---|---|--:|" + "--:|" * len(sec.endpoints)]
  for ps, cells in sec.replica_cells.items():
    for name, c in cells.items():
      out.append(f"| `{name}` | {ps} | {c.seeds} | "
                 + " | ".join(str(c.summary(e)) for e in sec.endpoints) + " |")
  return out + [""]


def _equivalence_markdown(eq: EquivalenceSection | None) -> list[str]:
  if eq is None:
    return []
  out = [f"### Equivalence (TOST on the {eq.set} prompts, Holm over its {eq.family} tests)", "",
         "| A - B | endpoint | margin | diff [90% CI] | p | Holm p | verdict |",
         "|---|---|--:|--:|--:|--:|---|"]
  for t in eq.tests:
    diff = "-" if t.diff is None else f"{t.diff:+.3f} [{t.ci90_low:+.3f}, {t.ci90_high:+.3f}]"
    p = "-" if t.p is None else f"{t.p:.3g}"
    q = "-" if t.p_holm is None else f"{t.p_holm:.3g}"
    out.append(f"| `{t.a}` - `{t.b}` | {t.endpoint} | {t.margin:g} | {diff} | {p} | {q} | "
               f"{t.verdict} |")
  return out + [""]


def _step_logs_markdown(logs: Mapping[str, StepLogCell] | None) -> list[str]:
  """Per run, its training steps' mean E[delta], pre-clip gradient norm and clipped share."""
  if not logs:
    return []
  out = ["### The step's own logs (means over training; mean over seeds [95% CI])", "",
         "| run | seeds | " + " | ".join(STEP_LOGS) + " |", "|---|--:|" + "--:|" * len(STEP_LOGS)]
  for name, c in logs.items():
    out.append(f"| `{name}` | {c.seeds} | "
               + " | ".join("-" if getattr(c, k) is None else str(getattr(c, k))
                            for k in STEP_LOGS) + " |")
  return out + [""]
