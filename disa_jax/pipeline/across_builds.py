"""One design read over several π_ref builds (issue 62, item 5: the build as a random factor).

The same preset run on independent builds of its models (pinned entries with other warm-up seeds,
`disa_jax/pipeline/pinned_models/README.md`) gives one report per build, each deciding its own
declared Holm family. Across the builds the rule declared in docs/preregistration.md (amendment
2026-12-07, 10:50 UTC) is intersection-union: a difference is *shown* only where every build's
report shows it in the same direction (no further correction is needed: the combined test rejects
only when each does); shown on some builds only, or in opposite directions, it is stated so; shown
on none, "not shown".

`read_across` pairs the builds' tests by (A, B, endpoint, prompt set): each report must hold the
same tests (a test missing from one is an error naming the report and the test), so the reading
covers the whole declared family of every build. Where a later build runs only some comparisons of
the design (declared so before its run: amendment 2026-12-07, 18:37 UTC), ``compare`` ('A:B', the
design's own spelling) names them: every build must hold every test of those comparisons, each
build's Holm p stays the one of its own report's family, and the other tests are not read.

    python -m disa_jax.pipeline.across_builds --name anchor_testbed_rl \\
        --reports anchor_testbed_rl anchor_testbed_rl_build2 \\
        --out docs/reports/across_builds_anchor_testbed_rl

(reads ``docs/reports/<report>.json``; writes ``<out>.json`` and ``<out>.md``; a sub-design:
``--compare disa_c1:disa_exact_c1 disa_c0:disa_exact_c0``).
"""
from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Mapping, Sequence

from disa_jax import codec
from disa_jax.pipeline import family
from disa_jax.pipeline.report_records import EndpointTest, split_comparison

ALPHA = family.ALPHA
SHOWN_ALL, SHOWN_SOME, OPPOSITE, NOT_SHOWN = ("shown on every build", "shown on some builds only",
                                              "shown in opposite directions", "not shown")


@dataclasses.dataclass(frozen=True, kw_only=True)
class BuildTest:
  """One build's test: its ``report``, the difference A - B and its Holm p in that report's own
  family, whether it is shown there (Holm p < alpha) and its direction in words ('A higher',
  'A earlier', ...; '' when not shown)."""
  report: str
  diff: float
  p_holm: float
  shown: bool
  direction: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class AcrossTest:
  """One test read across the builds: A - B on ``endpoint`` over prompt set ``set``, each
  build's `BuildTest` (in the order of the reports) and the ``reading`` (`SHOWN_ALL`,
  `SHOWN_SOME`, `OPPOSITE` or `NOT_SHOWN`), with the ``direction`` where every build shows it."""
  a: str
  b: str
  endpoint: str
  set: str
  builds: tuple[BuildTest, ...]
  reading: str
  direction: str = ""


@dataclasses.dataclass(frozen=True, kw_only=True)
class AcrossResult:
  """A design read across builds (``<out>.json``): its ``name``, the ``reports`` (one a build),
  ``alpha``, every test and the count of each reading (``counts``); ``compare``: the comparisons
  read when only some of the design's were (left out of the JSON when all were)."""
  name: str
  reports: tuple[str, ...]
  alpha: float
  tests: tuple[AcrossTest, ...]
  counts: Mapping[str, int]
  compare: tuple[str, ...] = codec.field(default=(), omit=())


def _build_test(report: str, t: EndpointTest, alpha: float) -> BuildTest:
  if t.p_holm is None or t.diff is None:
    raise ValueError(f"report {report!r}: test {t.a} - {t.b} / {t.endpoint} / {t.set} was not "
                     f"run (p_holm {t.p_holm!r}, diff {t.diff!r})")
  shown = t.p_holm < alpha
  return BuildTest(report=report, diff=float(t.diff), p_holm=float(t.p_holm), shown=shown,
                   direction=family.direction(t) if shown else "")


def _reading(builds: Sequence[BuildTest]) -> tuple[str, str]:
  directions = {b.direction for b in builds if b.shown}
  if not directions:
    return NOT_SHOWN, ""
  if len(directions) > 1:
    return OPPOSITE, ""
  if all(b.shown for b in builds):
    return SHOWN_ALL, directions.pop()
  return SHOWN_SOME, directions.pop()


def _pairs(name: str, compare: Sequence[str]) -> set[tuple[str, str]]:
  pairs = set()
  for c in compare:
    split = split_comparison(c)
    if split is None:
      raise ValueError(f"across builds {name!r}: compare entry {c!r} is not 'A:B'")
    pairs.add(split)
  return pairs


def read_across(name: str, reports: Mapping[str, Sequence[EndpointTest]],
                alpha: float = ALPHA, compare: Sequence[str] = ()) -> AcrossResult:
  """The tests of ``reports`` (report name -> its endpoint tests, one report a build) read by the
  intersection-union rule (module docstring), in the first report's order; with ``compare``
  ('A:B', ...) only the tests of those comparisons, which every report must hold."""
  if len(reports) < 2:
    raise ValueError(f"across builds {name!r}: needs the reports of 2 or more builds, got "
                     f"{list(reports)}")
  pairs = _pairs(name, compare)
  keyed = {}
  for report, tests in reports.items():
    run = [t for t in tests if t.p is not None]
    if not run:
      raise ValueError(f"report {report!r} has no endpoint tests")
    if pairs:
      missing = sorted(pairs - {(t.a, t.b) for t in run})
      if missing:
        raise ValueError(f"report {report!r} has no test of the comparison "
                         f"{missing[0][0]}:{missing[0][1]}")
      run = [t for t in run if (t.a, t.b) in pairs]
    keyed[report] = {(t.a, t.b, t.endpoint, t.set): t for t in run}
  first, *others = keyed
  for report in others:
    for missing, where in ((set(keyed[first]) - set(keyed[report]), report),
                           (set(keyed[report]) - set(keyed[first]), first)):
      if missing:
        a, b, endpoint, set_ = sorted(missing)[0]
        raise ValueError(f"report {where!r} lacks the test {a} - {b} / {endpoint} / {set_} "
                         f"({len(missing)} tests differ): the builds must share one design")
  out = []
  for key in keyed[first]:
    builds = tuple(_build_test(r, keyed[r][key], alpha) for r in keyed)
    reading, direction = _reading(builds)
    a, b, endpoint, set_ = key
    out.append(AcrossTest(a=a, b=b, endpoint=endpoint, set=set_, builds=builds, reading=reading,
                          direction=direction))
  counts = {r: sum(t.reading == r for t in out) for r in (SHOWN_ALL, SHOWN_SOME, OPPOSITE,
                                                          NOT_SHOWN)}
  return AcrossResult(name=name, reports=tuple(keyed), alpha=alpha, tests=tuple(out),
                      counts=counts, compare=tuple(compare))


def markdown(result: AcrossResult) -> list[str]:
  """The reading's table: every test, each build's difference and Holm p, the reading."""
  counts = "; ".join(f"{k}: {v}" for k, v in result.counts.items())
  head = " | ".join(f"{r}: diff, Holm p" for r in result.reports)
  only = (f" Only the comparisons {', '.join(f'`{c}`' for c in result.compare)} are read (the "
          f"design's part every build ran; each build's Holm p is its own report's family's)."
          if result.compare else "")
  out = [f"`{result.name}` across {len(result.reports)} π_ref builds ({', '.join(result.reports)};"
         f" each report its own Holm family, α = {result.alpha:g}), read by intersection-union: "
         f"{counts}.{only}", "",
         f"| A - B | endpoint | set | {head} | reading |",
         "|---|---|---|" + "--:|" * len(result.reports) + "---|"]
  for t in result.tests:
    cells = " | ".join(f"{b.diff:+.3f}, {b.p_holm:.2g}" for b in t.builds)
    reading = t.reading + (f": {t.direction}" if t.direction else "")
    out.append(f"| `{t.a}` - `{t.b}` | {t.endpoint} | {t.set} | {cells} | {reading} |")
  return out


def run(name: str, report_names: Sequence[str], reports_dir: Path,
        compare: Sequence[str] = ()) -> AcrossResult:
  """Reads ``reports_dir/<report>.json`` for each name and `read_across` them."""
  reports = family.load_reports(report_names, reports_dir, f"across builds {name!r}")
  return read_across(name, {r: rep.tests for r, rep in reports.items()}, compare=compare)


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--name", required=True)
  parser.add_argument("--reports", nargs="+", required=True,
                      help="report names under --reports-dir, without .json, one a build")
  parser.add_argument("--reports-dir", type=Path, default=Path("docs/reports"))
  parser.add_argument("--out", type=Path, help="path stem: writes <out>.json and <out>.md")
  parser.add_argument("--compare", nargs="+", default=(),
                      help="read only these comparisons ('A:B'), as a build's declared sub-design")
  args = parser.parse_args(argv)
  try:
    result = run(args.name, args.reports, args.reports_dir, args.compare)
  except ValueError as e:
    parser.exit(2, f"error: {e}\n")
  family.write_outputs(args.out, result, "\n".join(markdown(result)) + "\n")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
