"""The report's analysis sections, built from recorded runs, are the same JSON bytes as the
committed ones (key order included): the claims, the end states, matched accuracy (each seed's
and the summaries), the endpoints and the step-size pilot that `pipeline.report.write_report`
puts in report.json.

The runs (tests/fixtures/pipeline/recorded_runs.json): the exact measures (to 6 digits) and the
evaluation rows of 3 methods x 3 seeds of a default-preset job; the bytes
(recorded_sections.json) are what the pipeline wrote from them before its sections were typed
records (issue 64; written by main 4aea750's pipeline with this module's `_sections`)."""
import json
from pathlib import Path

import numpy as np

from disa_jax import codec
from disa_jax.pipeline import claims as C
from disa_jax.pipeline import dynamics as D
from disa_jax.pipeline import endpoints as EP
from disa_jax.pipeline import step_size as SZ
from disa_jax.pipeline.report import _matched_summary
from disa_jax.workflows.stage3 import SERIES_FIELDS, ExactSeries

FIXTURES = Path(__file__).parents[1] / "fixtures" / "pipeline"
METHODS = ("disa", "disa_exact", "grpo")
SEEDS = (0, 1, 2)


class _Run:
  """A recorded Stage 3 run as the sections read it (its metrics file and exact measures)."""

  def __init__(self, path: Path, series: ExactSeries):
    self.metrics_path, self._series = path, series

  def exact_series(self, prefix: str = "exact") -> ExactSeries:
    return self._series if prefix == "exact" else ExactSeries.from_rows([])


def _name(m, s):
  return m if s == 0 else f"{m}_seed{s}"


def _sections(tmp_path):
  rec = json.loads((FIXTURES / "recorded_runs.json").read_text())
  (tmp_path / "metrics.jsonl").write_text("")
  series = {n: ExactSeries(step=np.asarray(v["step"], np.int64),
                           **{f: np.asarray(v[f], np.float64) for f in SERIES_FIELDS})
            for n, v in rec["series"].items()}
  stage3 = {(m, s): _Run(tmp_path / "metrics.jsonl", series[_name(m, s)])
            for m in METHODS for s in SEEDS}
  runs = {m: {s: series[_name(m, s)] for s in SEEDS} for m in METHODS}
  cfg = D.EndStateConfig()
  ends = {m: [(s, D.end_state(x, cfg)) for s, x in r.items()] for m, r in runs.items()}
  states = {m: D.method_end_state([e for _, e in es], cfg) for m, es in ends.items()}
  matched = {m: [(s, D.matched_accuracy(x)) for s, x in r.items()] for m, r in runs.items()}
  rows = rec["runs"]
  ev = C.Evidence(seed_rows={m: [(s, rows[_name(m, s)]) for s in SEEDS] for m in METHODS},
                  method_states=states, matched_runs=matched, end_state=cfg,
                  reference_kl=rows["reference"][D.PRIMARY])
  plan = C.Plan(fix="", disa="disa", oracle="disa_exact", contrasts=("grpo",), controls=(),
                compare=("disa<>grpo",), replay=())
  pairs = EP.EndpointsConfig(compare=("disa:grpo", "disa:disa_exact")).pairs(METHODS)
  rule = EP.EndpointsConfig(step_size=METHODS, stable_level=0.9, stable_floor=0.5)
  return {
      "end_state": {m: [D.SeedEndState(state=e, seed=s) for s, e in es] for m, es in ends.items()},
      "end_state_methods": {m: codec.encode(e) for m, e in states.items()},
      "matched_accuracy": {m: {lvl: _matched_summary(x, lvl) for lvl in ("0.5", "0.7", "0.9")}
                           for m, x in matched.items()},
      "matched_accuracy_runs": {m: dict(x) for m, x in matched.items()},
      "endpoints": EP.section(EP.collect(stage3, {m: SEEDS for m in METHODS}), pairs),
      "step_size": SZ.step_size_section(stage3, {m: (1e-4 * (i + 1), SEEDS)
                                                 for i, m in enumerate(METHODS)}, rule),
      "step_size_missing": SZ.step_size_section(stage3, {"disa": (1e-4, SEEDS),
                                                         "absent": (1e-3, (0,))}, rule),
      "claims": C.build_claims(ev, plan, None)}


def test_the_sections_built_from_recorded_runs_are_the_committed_bytes(tmp_path):
  got = json.dumps(codec.encode(_sections(tmp_path)), indent=1, default=float)
  want = (FIXTURES / "recorded_sections.json").read_text()
  assert got == want
