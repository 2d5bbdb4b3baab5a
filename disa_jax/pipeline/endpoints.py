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
of their own); and a step-size pilot decided per group of runs ('<group>_lr<tag>').
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Mapping, Sequence

import numpy as np

from disa_jax.pipeline import censored, dynamics, seed_stats
from disa_jax.rl.metrics import read_jsonl
from disa_jax.workflows.stage3 import ExactSeries

ENDPOINTS = ("kl_auc", "kl_correct_end", "steps_to_p90")
KNOWN_ENDPOINTS = (*ENDPOINTS, "kl_end")
# The step's own logs summarised per cell (issue 62 item 6; logged, not tested): E[delta] (the mean
# TB residual: the baseline the log Z provides), the pre-clip gradient norm, the clipped share.
STEP_LOGS = ("tb_residual_mean", "grad_norm", "grad_clipped_share")
END_WINDOW = 0.25  # kl_end: the last quarter of the measured steps (the end-state rule's window)
LR_TAG = re.compile(r"(.*?)_?lr[0-9]+(?:em?[0-9]+)?")  # pilot runs '<group>_lr<tag>': per group
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

  def pairs(self, methods: Sequence[str]) -> list[tuple[str, str]]:
    """The comparisons as (A, B), each run checked against ``methods``."""
    return _split_pairs(self.compare, methods, "compare")


def _split_pairs(pairs: Sequence[str], methods: Sequence[str], field: str
                 ) -> list[tuple[str, str]]:
  out = []
  for i, pair in enumerate(pairs):
    a, sep, b = pair.partition(":")
    if not sep or not a or not b or a == b:
      raise ValueError(f"endpoints.{field}[{i}] must be 'A:B' with two different runs, got "
                       f"{pair!r}")
    for name in (a, b):
      if name not in methods:
        raise ValueError(f"endpoints.{field}[{i}]={pair!r}: {name!r} is not in methods "
                         f"{tuple(methods)}")
    out.append((a, b))
  return out


def run_endpoints(series: ExactSeries, level: float = P_LEVEL) -> dict[str, Any]:
  """The endpoints of one run's measurements on one prompt set.

  Args:
    series: its exact measures (>= 2 measurements).
    level: the P(correct) level of ``steps_to_p90``.

  Returns:
    {'kl_auc', 'kl_correct_end', 'kl_end', 'steps_to_p90' (interpolated; the last step if never reached,
    the first if already there), 'censored' (never reached the level), 'left_censored' (already
    there at a first measurement after step 0), 'p90_low', 'p90_high', 'p90_kind' (the
    `censored.Interval`; high None when never reached), 'measurements', 'first_step',
    'last_step'}.
  """
  step = np.asarray(series["step"], np.float64)
  if step.size < 2 or np.any(np.diff(step) <= 0):
    raise ValueError(f"run_endpoints needs >= 2 measurements at increasing steps, got steps "
                     f"{np.asarray(series['step']).tolist()}")
  kl = np.asarray(series["kl_decomposed"], np.float64)
  auc = float(np.sum((kl[1:] + kl[:-1]) / 2.0 * np.diff(step)) / (step[-1] - step[0]))
  crossing = dynamics.matched_accuracy(series, (level,))[f"{level:g}"]  # the interpolated step
  reach = float(step[-1]) if crossing is None else crossing["step"]
  when = censored.time_to_level(step, series["p_correct"], level)
  window = step >= step[-1] - END_WINDOW * (step[-1] - step[0])
  return {"kl_auc": auc, "kl_correct_end": float(series["kl_correct"][-1]),
          "kl_end": float(kl[window].mean()),
          "steps_to_p90": reach, "censored": when.kind == "right",
          "left_censored": when.kind == "left", "p90_low": when.low,
          "p90_high": None if when.kind == "right" else when.high, "p90_kind": when.kind,
          "measurements": int(step.size), "first_step": int(step[0]), "last_step": int(step[-1])}


def collect(stage3: Mapping[tuple[str, int], Any], run_seeds: Mapping[str, Sequence[int]]
            ) -> dict[str, dict[str, list[dict[str, Any]]]]:
  """Prompt set -> run -> its seeds' `run_endpoints`, from each finished run's metrics.

  Args:
    stage3: (run, seed) -> `Stage3Run` (the job's runs; a missing one is left out).
    run_seeds: run -> its Stage 3 seeds (the runs of the section).

  A prompt set no run measured (no held-out tracking) is left out; a run with fewer than 2
  measurements of a set has no endpoints there.
  """
  out: dict[str, dict[str, list[dict[str, Any]]]] = {}
  for ps, prefix in PROMPT_SETS.items():
    for name, seeds in run_seeds.items():
      for seed in seeds:
        run = stage3.get((name, seed))
        if run is None or not run.metrics_path.exists():
          continue
        series = run.exact_series(prefix)
        if series["step"].size >= 2:
          out.setdefault(ps, {}).setdefault(name, []).append(run_endpoints(series) | {"seed": seed})
  return out


def stability(series: ExactSeries, level: float, floor: float) -> dict[str, Any]:
  """The step-size rule on one run's training-prompt measurements (`EndpointsConfig`): stable
  when P(correct) is >= ``level`` at the last measurement and >= ``floor`` at every one."""
  p = np.asarray(series["p_correct"], np.float64)
  if p.size == 0:
    raise ValueError("stability needs >= 1 measurement of P(correct), got none")
  low = int(np.argmin(p))
  return {"stable": bool(p[-1] >= level and p[low] >= floor), "p_last": float(p[-1]),
          "p_min": float(p[low]), "p_min_step": int(series["step"][low]),
          "last_step": int(series["step"][-1]), "measurements": int(p.size)}


def step_logs(stage3: Mapping[tuple[str, int], Any], run_seeds: Mapping[str, Sequence[int]]
              ) -> dict[str, dict[str, Any]]:
  """Run -> per `STEP_LOGS` key, the mean over its seeds (95% interval) of each seed's mean over
  the training steps that logged it (a run without any such row is left out)."""
  out: dict[str, dict[str, Any]] = {}
  for name, seeds in run_seeds.items():
    per_seed = []
    for seed in seeds:
      run = stage3.get((name, seed))
      if run is None or not run.metrics_path.exists():
        continue
      rows = read_jsonl(str(run.metrics_path))
      means = {k: float(np.mean([r[k] for r in rows if k in r])) for k in STEP_LOGS
               if any(k in r for r in rows)}
      if means:
        per_seed.append(means)
    keys = [k for k in STEP_LOGS if per_seed and all(k in m for m in per_seed)]
    if keys:
      out[name] = {"seeds": len(per_seed)} | {
          k: _cell([{k: m[k], "censored": False} for m in per_seed], (k,))[k] for k in keys}
  return out


def step_size_section(stage3: Mapping[tuple[str, int], Any],
                      runs: Mapping[str, tuple[float, Sequence[int]]],
                      rule: EndpointsConfig) -> dict[str, Any]:
  """The report's ``step_size`` section: the pilot's rule on each run and the lr it picks.

  Args:
    stage3: (run, seed) -> `Stage3Run` (a missing run or one without measurements: not decided).
    runs: the pilot's runs, name -> (its peak lr, its seeds).
    rule: its ``stable_level`` and ``stable_floor``.

  Returns:
    {'runs': one row per (run, seed) with its lr and `stability` (or 'missing'), 'chosen': the
    largest lr whose every seed is stable (None: none is, or a run is missing), 'chosen_run',
    'level', 'floor', 'verdict'}.
  """
  level, floor = rule.stable_level, rule.stable_floor
  rows, stable_lrs, missing = [], {}, []
  for name, (lr, seeds) in runs.items():
    ok = True
    for seed in seeds:
      run = stage3.get((name, seed))
      series = None if run is None or not run.metrics_path.exists() else run.exact_series("exact")
      if series is None or series["step"].size == 0:
        rows.append({"run": name, "seed": seed, "lr": lr, "missing": True})
        missing.append(f"{name} (seed {seed})")
        ok = False
        continue
      row = stability(series, level, floor)
      rows.append({"run": name, "seed": seed, "lr": lr, "missing": False, **row})
      ok = ok and row["stable"]
    if ok:
      stable_lrs[name] = lr
  groups: dict[str, list[str]] = {}
  for name in runs:
    groups.setdefault(pilot_group(name), []).append(name)
  lrs = {name: lr for name, (lr, _) in runs.items()}
  picks = {g: _pick(names, lrs, stable_lrs, missing, level, floor) for g, names in groups.items()}
  one = next(iter(picks.values())) if len(picks) == 1 else {
      "chosen": None, "chosen_run": None,
      "verdict": f"{sum(p['chosen'] is not None for p in picks.values())} of {len(picks)} groups "
                 f"have a stable lr"}
  return {"runs": rows, "chosen": one["chosen"], "chosen_run": one["chosen_run"], "level": level,
          "floor": floor, "verdict": one["verdict"], **({"groups": picks} if len(picks) > 1 else {})}


def pilot_group(name: str) -> str:
  """The group of pilot run ``name``: 'disa_c1_lr3em4' -> 'disa_c1', 'lr3em4' -> '' (a name
  without an lr tag is its own group)."""
  m = LR_TAG.fullmatch(name)
  return m.group(1) if m else name


def _pick(names: Sequence[str], lrs: Mapping[str, float], stable_lrs: Mapping[str, float],
          missing: Sequence[str], level: float, floor: float) -> dict[str, Any]:
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
  return {"chosen": None if best is None else ok[best], "chosen_run": best, "verdict": verdict}


def step_size_markdown(sec: Mapping[str, Any]) -> list[str]:
  """The step-size pilot's table of report.md (with a pilot of several groups, each group's
  choice first)."""
  out = ["## Step-size pilot (docs/preregistration.md)", "",
         f"Stable: training P(correct) >= {sec['level']:g} at the last measurement and never below "
         f"{sec['floor']:g}. **{sec['verdict']}**.", ""]
  if "groups" in sec:
    out += ["| group | chosen lr | verdict |", "|---|--:|---|"]
    out += [f"| `{g}` | {'-' if p['chosen'] is None else format(p['chosen'], 'g')} | "
            f"{p['verdict']} |" for g, p in sec["groups"].items()] + [""]
  out += ["| run | seed | lr | P(correct) last | min (step) | stable |", "|---|--:|--:|--:|--:|---|"]
  for r in sec["runs"]:
    if r["missing"]:
      out.append(f"| `{r['run']}` | {r['seed']} | {r['lr']:g} | - | - | not measured |")
    else:
      out.append(f"| `{r['run']}` | {r['seed']} | {r['lr']:g} | {r['p_last']:.3f} | "
                 f"{r['p_min']:.3f} ({r['p_min_step']}) | {'yes' if r['stable'] else 'no'} |")
  return out + [""]


def _cell(rows: Sequence[Mapping[str, Any]], endpoints: Sequence[str] = ENDPOINTS
          ) -> dict[str, Any]:
  """Per endpoint: mean and 95% interval over the seeds' values (n >= 2), or the lone value."""
  out: dict[str, Any] = {"seeds": len(rows),
                         "censored": int(sum(bool(r["censored"]) for r in rows)),
                         "left_censored": int(sum(bool(r.get("left_censored")) for r in rows))}
  for e in endpoints:
    x = [float(r[e]) for r in rows]
    if len(x) >= 2 and len(set(x)) > 1:
      s = seed_stats.one_sample(x)
      out[e] = {"mean": s.mean, "ci_low": s.ci_low, "ci_high": s.ci_high}
    elif len(x) >= 2:  # every seed the same value (e.g. all censored at the last step)
      out[e] = {"mean": x[0], "ci_low": x[0], "ci_high": x[0]}
    else:
      out[e] = {"mean": x[0] if x else float("nan"), "ci_low": None, "ci_high": None}
  return out


def replica_unit(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
  """One anchor replica's unit from its seeds' `run_endpoints`: each endpoint's mean; the steps to
  the level as the interval of the mean (the mean of the lower bounds, of the upper bounds)."""
  if not rows:
    raise ValueError("replica_unit needs >= 1 run of the replica, got none")
  out: dict[str, Any] = {e: float(np.mean([r[e] for r in rows])) for e in KNOWN_ENDPOINTS
                         if all(e in r for r in rows)}
  kinds = {r["p90_kind"] for r in rows}
  high = [float("inf") if r["p90_high"] is None else float(r["p90_high"]) for r in rows]
  low = float(np.mean([r["p90_low"] for r in rows]))
  kind = ("exact" if kinds == {"exact"} else "right" if "right" in kinds else
          "left" if low == 0 else "interval")
  return out | {"censored": kind == "right", "left_censored": kind == "left", "p90_low": low,
                "p90_high": None if kind == "right" else float(np.mean(high)), "p90_kind": kind,
                "seeds": [r.get("seed") for r in rows]}


def units(runs: Mapping[str, Sequence[Mapping[str, Any]]], name: str,
          replicas: Mapping[str, Sequence[str]]) -> list[dict[str, Any]]:
  """A cell's analysis units on one prompt set: its seeds, or (a cell run on several anchor
  replicas, `MainConfig.anchor_replicas`) each replica's `replica_unit`."""
  if name not in replicas:
    return list(runs.get(name, ()))
  return [replica_unit(runs[r]) for r in replicas[name] if runs.get(r)]


def section(per_run: Mapping[str, Mapping[str, Sequence[Mapping[str, Any]]]],
            pairs: Sequence[tuple[str, str]], *,
            rule: EndpointsConfig | None = None,
            replicas: Mapping[str, Sequence[str]] | None = None,
            equivalence: Sequence[tuple[str, str]] = ()) -> dict[str, Any]:
  """The report's ``endpoints`` section.

  Args:
    per_run: prompt set ('train' | 'heldout') -> run name -> its seeds' `run_endpoints`.
    pairs: the declared comparisons (A, B).
    rule: the preset's endpoints section (its ``endpoints`` and ``margins``; None: the default).
    replicas: cell -> its run on each anchor replica (a cell named here is tested over replica
      units, `units`; {} / None: every cell over seeds).
    equivalence: the declared equivalence comparisons (A, B) (TOST on the training prompts).

  Returns:
    {'cells': set -> run -> `_cell`, 'tests': one row per (A, B, endpoint, set) with the
    difference, its 95% interval, the raw and Holm p-values and the verdict, 'family': the
    number of tests Holm corrects over}, and with replicas or equivalence tests their sections.
  """
  rule, replicas = rule or EndpointsConfig(), dict(replicas or {})
  ends = tuple(rule.endpoints)
  cells = {ps: {name: _cell(rows, ends) for name, rows in runs.items()}
           for ps, runs in per_run.items()}
  tests: list[dict[str, Any]] = []
  for ps, runs in per_run.items():
    for a, b in pairs:
      for e in ends:
        tests.append(_test(units(runs, a, replicas), units(runs, b, replicas), a, b, e, ps))
  tested = [t for t in tests if t["p"] is not None]
  adjusted = seed_stats.holm([t["p"] for t in tested]) if tested else []
  for t, q in zip(tested, adjusted):
    t["p_holm"] = float(q)
    lower, higher = (("A earlier", "A later") if t.get("method") == "gehan" else
                     ("A lower", "A higher"))
    t["verdict"] = ((lower if t["diff"] < 0 else higher) if q < ALPHA else
                    f"undecided (Holm p = {q:.3g} >= {ALPHA:g})")
  out = {"cells": cells, "tests": tests, "family": len(tested), "alpha": ALPHA,
         "endpoints": list(ends), "p_level": P_LEVEL}
  if replicas:
    out["replica_cells"] = {ps: {c: _cell(units(runs, c, replicas), ends) for c in replicas}
                            for ps, runs in per_run.items()}
  if equivalence:
    out["equivalence"] = equivalence_tests(per_run.get("train", {}), equivalence, rule.margins,
                                           replicas)
  return out


def equivalence_tests(runs: Mapping[str, Sequence[Mapping[str, Any]]],
                      pairs: Sequence[tuple[str, str]], margins: Mapping[str, float],
                      replicas: Mapping[str, Sequence[str]]) -> dict[str, Any]:
  """TOST of |mean(A) - mean(B)| < margin per pair and margin's endpoint on the training prompts'
  units, Holm over the tests run (a family of its own)."""
  tests = []
  for a, b in pairs:
    ua, ub = units(runs, a, replicas), units(runs, b, replicas)
    for e, m in margins.items():
      row: dict[str, Any] = {"a": a, "b": b, "endpoint": e, "margin": float(m), "p": None,
                             "p_holm": None, "diff": None, "ci90_low": None, "ci90_high": None,
                             "n_a": len(ua), "n_b": len(ub)}
      try:
        w = seed_stats.welch([u[e] for u in ua], [u[e] for u in ub], level=0.9)
      except ValueError as err:  # < 2 units a side, or constant on both
        row["verdict"] = f"not tested ({err})"
      else:
        row.update(p=float(w.tost_p(m)), diff=w.diff, ci90_low=w.ci_low, ci90_high=w.ci_high)
      tests.append(row)
  tested = [t for t in tests if t["p"] is not None]
  for t, q in zip(tested, seed_stats.holm([t["p"] for t in tested]) if tested else []):
    t["p_holm"] = float(q)
    t["verdict"] = (f"shown equivalent within +-{t['margin']:g}" if q < ALPHA else
                    f"equivalence not shown (Holm p = {q:.3g})")
  return {"tests": tests, "family": len(tested), "alpha": ALPHA, "set": "train"}


def _test(ra: Sequence[Mapping[str, Any]], rb: Sequence[Mapping[str, Any]], a: str, b: str,
          endpoint: str, prompt_set: str) -> dict[str, Any]:
  """One declared test: Welch over seeds (Gehan's for ``steps_to_p90``), or why it was not run."""
  row: dict[str, Any] = {"a": a, "b": b, "endpoint": endpoint, "set": prompt_set, "p": None,
                         "p_holm": None, "diff": None, "ci_low": None, "ci_high": None,
                         "n_a": len(ra), "n_b": len(rb),
                         "method": "gehan" if endpoint == "steps_to_p90" else "welch"}
  why = None
  if len(ra) < 2 or len(rb) < 2:
    why = f"{len(ra)} / {len(rb)} seeds (a test needs >= 2 a side)"
  elif endpoint == "steps_to_p90":
    g = censored.gehan_test([_interval(r) for r in ra], [_interval(r) for r in rb])
    # diff < 0: A got there first (earlier), as for a difference of steps
    row.update(p=g.p, diff=-g.effect, kinds=list(g.kinds), splits=g.splits)
    return row
  if why is None:
    try:
      c = seed_stats.welch([r[endpoint] for r in ra], [r[endpoint] for r in rb])
    except ValueError as e:  # constant on both sides: no test
      why = str(e)
    else:
      row.update(p=c.p, diff=c.diff, ci_low=c.ci_low, ci_high=c.ci_high)
  if why is not None:
    row["verdict"] = f"undecided ({why})"
  return row


def _interval(r: Mapping[str, Any]) -> censored.Interval:
  """A run's `run_endpoints` steps to the level as a `censored.Interval`."""
  high = r["p90_high"]
  return censored.Interval(low=r["p90_low"], high=float("inf") if high is None else high,
                           kind=r["p90_kind"])


def markdown(sec: Mapping[str, Any]) -> list[str]:
  """The endpoint tables of report.md (a section from before issue 62, with Welch on every
  endpoint, in its own words)."""
  gehan = any(t.get("method") == "gehan" for t in sec["tests"])
  tests = ("Welch on kl_auc and kl_correct_end, Gehan's permutation test for interval-censored "
           "data on steps_to_p90 (diff: minus its effect, the share of cross pairs where A's run "
           "certainly got there first minus B's), two-sided" if gehan else "Welch, two-sided")
  out = ["## Pre-registered endpoints (docs/preregistration.md)", "",
         f"Means over seeds with 95% intervals; `steps_to_p90` is the step where P(correct) first "
         f"reaches {sec['p_level']:g} (censored runs counted apart). Tests: {tests}, Holm over the "
         f"{sec['family']} tests run.", ""]
  left = any("left_censored" in c for cells in sec["cells"].values() for c in cells.values())
  for ps, cells in sec["cells"].items():
    out += [f"### {ps} prompts", "", "| run | seeds | " + " | ".join(sec["endpoints"])
            + (" | never reached / already past |" if left else " | censored |"),
            "|---|--:|" + "--:|" * len(sec["endpoints"]) + "--:|"]
    for name, c in cells.items():
      vals = [_fmt(c[e]) for e in sec["endpoints"]]
      cens = f"{c['censored']} / {c['left_censored']}" if left else f"{c['censored']}"
      out.append(f"| `{name}` | {c['seeds']} | " + " | ".join(vals) + f" | {cens} |")
    out.append("")
  out += ["| A - B | set | endpoint | diff [95% CI] | p | Holm p | verdict |",
          "|---|---|---|--:|--:|--:|---|"]
  for t in sec["tests"]:
    if t["diff"] is None:
      diff = "-"
    elif t.get("method") == "gehan":
      diff = f"{t['diff']:+.3f} (Gehan)"
    else:
      diff = f"{t['diff']:+.3f} [{t['ci_low']:+.3f}, {t['ci_high']:+.3f}]"
    p = "-" if t["p"] is None else f"{t['p']:.3g}"
    q = "-" if t["p_holm"] is None else f"{t['p_holm']:.3g}"
    out.append(f"| `{t['a']}` - `{t['b']}` | {t['set']} | {t['endpoint']} | {diff} | {p} | {q} "
               f"| {t['verdict']} |")
  return (out + [""] + _replica_markdown(sec) + _equivalence_markdown(sec.get("equivalence"))
          + _step_logs_markdown(sec.get("step_logs")))


def _step_logs_markdown(logs: Mapping[str, Any] | None) -> list[str]:
  """Per run, its training steps' mean E[delta], pre-clip gradient norm and clipped share."""
  if not logs:
    return []
  out = ["### The step's own logs (means over training; mean over seeds [95% CI])", "",
         "| run | seeds | " + " | ".join(STEP_LOGS) + " |", "|---|--:|" + "--:|" * len(STEP_LOGS)]
  for name, c in logs.items():
    out.append(f"| `{name}` | {c['seeds']} | "
               + " | ".join(_fmt(c[k]) if k in c else "-" for k in STEP_LOGS) + " |")
  return out + [""]


def _replica_markdown(sec: Mapping[str, Any]) -> list[str]:
  """The cells run on several anchor replicas, over their replica units (what the tests read)."""
  if "replica_cells" not in sec:
    return []
  out = ["### Cells over anchor replicas (the tests' units: a replica's mean over its seeds)", "",
         "| cell | set | replicas | " + " | ".join(sec["endpoints"]) + " |",
         "|---|---|--:|" + "--:|" * len(sec["endpoints"])]
  for ps, cells in sec["replica_cells"].items():
    for name, c in cells.items():
      out.append(f"| `{name}` | {ps} | {c['seeds']} | "
                 + " | ".join(_fmt(c[e]) for e in sec["endpoints"]) + " |")
  return out + [""]


def _equivalence_markdown(eq: Mapping[str, Any] | None) -> list[str]:
  if not eq:
    return []
  out = [f"### Equivalence (TOST on the {eq['set']} prompts, Holm over its {eq['family']} tests)",
         "", "| A - B | endpoint | margin | diff [90% CI] | p | Holm p | verdict |",
         "|---|---|--:|--:|--:|--:|---|"]
  for t in eq["tests"]:
    diff = ("-" if t["diff"] is None else
            f"{t['diff']:+.3f} [{t['ci90_low']:+.3f}, {t['ci90_high']:+.3f}]")
    p = "-" if t["p"] is None else f"{t['p']:.3g}"
    q = "-" if t["p_holm"] is None else f"{t['p_holm']:.3g}"
    out.append(f"| `{t['a']}` - `{t['b']}` | {t['endpoint']} | {t['margin']:g} | {diff} | {p} | "
               f"{q} | {t['verdict']} |")
  return out + [""]


def _fmt(v: Mapping[str, Any]) -> str:
  if v["ci_low"] is None:
    return f"{v['mean']:.3f}"
  return f"{v['mean']:.3f} [{v['ci_low']:.3f}, {v['ci_high']:.3f}]"
