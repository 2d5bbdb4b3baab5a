"""One Holm family across several reports (issue 62, item 4).

A report corrects over its own tests (`endpoints.section`: Holm over the report's family). A
paragraph that draws on several reports needs one family over every test it draws on, declared
before reading the corrected verdicts. The declaration is a table in docs/preregistration.md
between ``<!-- family: NAME -->`` and ``<!-- end family -->``::

  | report | comparison | endpoint | set |
  |---|---|---|---|
  | anchor_testbed_rl_oneanchor | disa:disa_exact | * | * |

one row per (report under the reports directory, without ``.json``; a declared comparison 'A:B' of
its ``endpoints`` section; an endpoint; a prompt set), ``*`` for every endpoint / set the report
tested. `family_tests` matches every row to the report's tests (a row that matches none, or a test
matched twice, is an error naming the row); `decide` runs Holm over the family's raw p-values and
gives each test its verdict under the one family beside the report's own.

A ``steps_to_p90`` test that a report from before issue 62 decided by Welch over interpolated
steps is flagged when a run of either side was already past the level at its first measurement
(left-censored: the report's ``matched_accuracy_runs``, training prompts; the held-out prompts'
runs are not in the report, so a held-out test is flagged when the same comparison's training runs
are): its raw p is no valid test, it stays in the family (which only makes the others' correction
stricter) and it reads "not shown (left-censored: ...)".

Regenerate the README decision paragraph's family table with::

  python -m disa_jax.pipeline.family --family readme_decision --out docs/reports/family_readme_decision

(reads docs/preregistration.md and docs/reports/; writes ``<out>.json`` and ``<out>.md``).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import re
from pathlib import Path
from typing import Any, Mapping, Sequence

from disa_jax import codec
from disa_jax.pipeline import seed_stats
from disa_jax.pipeline.report_records import EndpointTest

ALPHA = 0.05
COLUMNS = ("report", "comparison", "endpoint", "set")
LEVEL = "0.9"  # the level of ``steps_to_p90`` in ``matched_accuracy_runs``


@dataclasses.dataclass(frozen=True)
class Declared:
  """One row of a declared family (``*``: every endpoint / set the report tested)."""
  report: str
  comparison: str
  endpoint: str
  set: str
  line: int


def parse_family(text: str, name: str, where: str = "docs/preregistration.md") -> list[Declared]:
  """The rows of family ``name`` declared in ``text`` (`Declared`, in order)."""
  start = re.search(rf"^<!-- family: {re.escape(name)} -->\s*$", text, re.M)
  if start is None:
    raise ValueError(f"{where}: no family {name!r} (a '<!-- family: {name} -->' line)")
  end = text.find("<!-- end family -->", start.end())
  if end < 0:
    raise ValueError(f"{where}: family {name!r} has no '<!-- end family -->' line")
  first_line = text.count("\n", 0, start.end()) + 2
  rows, header = [], None
  for i, line in enumerate(text[start.end():end].strip("\n").splitlines()):
    cells = [c.strip().strip("`") for c in line.strip().strip("|").split("|")]
    if not line.strip() or set("".join(cells)) <= set("-: "):
      continue
    if header is None:
      header = tuple(c.lower() for c in cells)
      if header != COLUMNS:
        raise ValueError(f"{where}:{first_line + i}: family {name!r} needs the columns {COLUMNS}, "
                         f"got {header}")
      continue
    if len(cells) != 4 or not all(cells) or ":" not in cells[1]:
      raise ValueError(f"{where}:{first_line + i}: a row needs a report, a comparison 'A:B', an "
                       f"endpoint and a set ('*' for all), got {line.strip()!r}")
    rows.append(Declared(*cells, line=first_line + i))
  if not rows:
    raise ValueError(f"{where}: family {name!r} declares no test")
  return rows


@dataclasses.dataclass(frozen=True, kw_only=True)
class LevelMatch:
  """A seed at one accuracy level (report.json's ``matched_accuracy_runs``; the family reads only
  whether it was ``already_past`` the level at its first measurement)."""
  already_past: bool


@dataclasses.dataclass(frozen=True, kw_only=True)
class FamilyReport:
  """What the family reads of a report.json (`read_report`): its endpoint tests (() without an
  ``endpoints`` section) and, per run, seed ('0', ...) and level ('0.9'), its `LevelMatch` (None:
  the level not reached)."""
  tests: tuple[EndpointTest, ...] = codec.field(default=(), key="endpoints.tests")
  matched_accuracy_runs: Mapping[str, Mapping[str, Mapping[str, LevelMatch | None]]] = \
      codec.field(default_factory=dict)


def read_report(obj: Mapping[str, Any], path: str | Path = "report.json") -> FamilyReport:
  """The family's view of report.json's contents ``obj`` (read from ``path``)."""
  return codec.decode(FamilyReport, obj, path)


@dataclasses.dataclass(frozen=True, kw_only=True)
class FamilyTest:
  """One test of the family: its ``report`` and the report's own `EndpointTest` (its keys inline),
  the runs already past the level per side (``left_censored``: a ``steps_to_p90`` test decided
  by Welch), and, once `decide`d, its Holm p over the family, the family's verdict, whether that
  differs from the report's own in whether a difference is shown (``flipped``) and why
  (``flip_cause``: 'holm' | 'censoring' | None)."""
  report: str
  test: EndpointTest = codec.field(inline=True)
  left_censored: Mapping[str, int] | None = codec.field(default=None, omit=None)
  p_family: float | None = None
  verdict_family: str = ""
  flipped: bool = False
  flip_cause: str | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class FamilyResult:
  """A decided family (`run`; ``<out>.json``): its name, where it is declared, ``alpha``, its
  tests, their number (``size``), how many verdicts differ from their report's own (``flipped``)
  and how many of those by the family's correction (``flipped_by_holm``)."""
  family: str
  declared_in: str
  alpha: float
  tests: tuple[FamilyTest, ...]
  size: int
  flipped: int
  flipped_by_holm: int


def _left_censored(report: FamilyReport, a: str, b: str) -> dict[str, int]:
  """Per side, the runs already past P(correct) 0.9 at their first training measurement."""
  runs = report.matched_accuracy_runs
  count = lambda m: sum(1 for v in runs.get(m, {}).values()
                        if v.get(LEVEL) is not None and v[LEVEL].already_past)
  return {a: count(a), b: count(b)}


def family_tests(rows: Sequence[Declared], reports: Mapping[str, FamilyReport]
                 ) -> list[FamilyTest]:
  """Every test the rows declare, from the reports (report name -> `read_report`), in row order:
  the report's own test (raw and Holm p, verdict) with ``report`` and, for a ``steps_to_p90`` test
  decided by Welch, ``left_censored`` (per side; see the module docstring)."""
  out: list[FamilyTest] = []
  seen: dict[tuple, int] = {}
  for row in rows:
    rep = reports.get(row.report)
    if rep is None:
      raise ValueError(f"family row {row.line}: no report {row.report!r} (have {sorted(reports)})")
    a, _, b = row.comparison.partition(":")
    hit = [t for t in rep.tests if (t.a, t.b) == (a, b) and t.p is not None
           and row.endpoint in ("*", t.endpoint) and row.set in ("*", t.set)]
    if not hit:
      raise ValueError(f"family row {row.line}: report {row.report!r} has no tested "
                       f"{row.comparison} / {row.endpoint} / {row.set}")
    for t in hit:
      key = (row.report, a, b, t.endpoint, t.set)
      if key in seen:
        raise ValueError(f"family row {row.line}: {key} is already in the family (row "
                         f"{seen[key]})")
      seen[key] = row.line
      welch = t.endpoint == "steps_to_p90" and t.method in (None, "welch")
      out.append(FamilyTest(report=row.report, test=t,
                            left_censored=_left_censored(rep, a, b) if welch else None))
  return out


def _verdict(t: FamilyTest, q: float, alpha: float) -> str:
  past = t.left_censored or {}
  if any(past.values()):
    sides = ", ".join(f"{m} {k}" for m, k in past.items())
    return f"not shown (left-censored runs at the first measurement: {sides}; Welch invalid)"
  if q >= alpha:
    return f"not shown (Holm p = {q:.3g} >= {alpha:g})"
  return direction(t.test)


def direction(t: EndpointTest) -> str:
  """A shown difference in words: 'A lower' / 'A higher' (a Gehan test of steps to a level:
  'A earlier' / 'A later')."""
  lower, higher = ("A earlier", "A later") if t.method == "gehan" else ("A lower", "A higher")
  return lower if t.diff < 0 else higher


def decide(tests: Sequence[FamilyTest], alpha: float = ALPHA) -> list[FamilyTest]:
  """Holm over the family's raw p-values; each test with ``p_family`` (its adjusted p),
  ``verdict_family``, ``flipped`` (the family's verdict differs from the report's own in whether a
  difference is shown) and ``flip_cause`` ('holm': the family's correction; 'censoring': a
  left-censored Welch test the family's correction alone would have kept; None)."""
  adjusted = seed_stats.holm([t.test.p for t in tests])
  out = []
  for t, q in zip(tests, adjusted):
    v = _verdict(t, float(q), alpha)
    shown_alone = t.test.p_holm is not None and t.test.p_holm < alpha
    flipped = shown_alone != (not v.startswith("not shown"))
    cause = None if not flipped else ("holm" if q >= alpha or not shown_alone else "censoring")
    out.append(dataclasses.replace(t, p_family=float(q), verdict_family=v, flipped=flipped,
                                   flip_cause=cause))
  return out


def markdown(name: str, decided: Sequence[FamilyTest]) -> list[str]:
  """The family's table: every test, its report's verdict and the family's."""
  cause = lambda c: sum(t.flip_cause == c for t in decided)
  out = [f"Family `{name}` (docs/preregistration.md): Holm over {len(decided)} tests from "
         f"{len({t.report for t in decided})} reports; "
         f"{sum(t.flipped for t in decided)} verdicts differ from their report's own "
         f"(per-report Holm): {cause('holm')} by the one family's correction, "
         f"{cause('censoring')} more by left-censoring (Welch over runs already past the level).",
         "",
         "| report | A - B | endpoint | set | diff | p | Holm p (report) | report's verdict | "
         "Holm p (family) | family's verdict |", "|---|---|---|---|--:|--:|--:|---|--:|---|"]
  for f in decided:
    t, mark = f.test, " **(changed)**" if f.flipped else ""
    out.append(f"| {f.report} | `{t.a}` - `{t.b}` | {t.endpoint} | {t.set} | "
               f"{t.diff:+.3f} | {t.p:.3g} | {t.p_holm:.3g} | {t.verdict} | "
               f"{f.p_family:.3g} | {f.verdict_family}{mark} |")
  return out


def load_reports(names: Sequence[str], reports_dir: Path, what: str) -> dict[str, FamilyReport]:
  """``reports_dir/<name>.json`` read (`read_report`) for each name; a missing file is an error
  naming ``what`` asked for it and the path."""
  reports = {}
  for r in names:
    path = reports_dir / f"{r}.json"
    if not path.is_file():
      raise ValueError(f"{what}: no report {path}")
    reports[r] = read_report(json.loads(path.read_text()), path)
  return reports


def write_outputs(out: Path | None, result: Any, md: str) -> None:
  """A command's result: ``<out>.json`` (`codec.encode`) and ``<out>.md`` when ``out`` is given,
  and the markdown on stdout."""
  if out is not None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(codec.encode(result), indent=1) + "\n")
    out.with_suffix(".md").write_text(md)
  print(md, end="")


def run(prereg: Path, name: str, reports_dir: Path) -> FamilyResult:
  """The family ``name`` declared in ``prereg``, decided over the reports in ``reports_dir``."""
  rows = parse_family(prereg.read_text(), name, str(prereg))
  reports = load_reports(list(dict.fromkeys(row.report for row in rows)), reports_dir,
                         f"family {name!r}")
  decided = decide(family_tests(rows, reports))
  return FamilyResult(family=name, declared_in=prereg.name, alpha=ALPHA, tests=tuple(decided),
                      size=len(decided), flipped=sum(t.flipped for t in decided),
                      flipped_by_holm=sum(t.flip_cause == "holm" for t in decided))


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--family", required=True)
  parser.add_argument("--prereg", type=Path, default=Path("docs/preregistration.md"))
  parser.add_argument("--reports", type=Path, default=Path("docs/reports"))
  parser.add_argument("--out", type=Path, help="path stem: writes <out>.json and <out>.md")
  args = parser.parse_args(argv)
  try:
    result = run(args.prereg, args.family, args.reports)
  except ValueError as e:
    parser.exit(2, f"error: {e}\n")
  write_outputs(args.out, result, "\n".join(markdown(args.family, result.tests)) + "\n")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
