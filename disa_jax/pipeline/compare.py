"""Do two runs of one job decide the same things? Two report.json side by side.

Issue 62 asks that the default job decide the same claims on two CPU types: XLA's CPU code
differs by processor, so a job's numbers differ between machines even from the same pinned models,
and what must agree is what the report *decides*. This module reads two reports (the codec's
records: `Claim`, `EndpointsSection`, `Provenance`) and lines up every decision both can make:

* each claim (matched by its text): its verdict ('holds' / 'does not hold' / 'undecided');
* each declared endpoint test (A - B, endpoint, prompt set): 'A lower' / 'A higher' / 'A earlier'
  / 'A later' or 'undecided' (the reason in brackets dropped: its Holm p is shown beside);
* each equivalence test: 'shown equivalent', 'equivalence not shown' or 'not tested';
* each declared reading (prompt set, endpoint, arm): its pattern.

A decision present in one report only is listed as such and counts as a difference. The header
names each report's processor, model source and the package versions that differ.

    python -m disa_jax.pipeline.compare A/report.json B/report.json [--out F.md]

Exit status 0 when every decision agrees, 1 when one differs, 2 when a file is not a report.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Sequence

from disa_jax import codec
from disa_jax.pipeline.endpoints import EndpointsSection
from disa_jax.pipeline.provenance import Provenance
from disa_jax.pipeline.report_records import Claim


@dataclasses.dataclass(frozen=True, kw_only=True)
class Decision:
  """One decision of a report: its ``kind`` ('claim' | 'endpoint' | 'equivalence' | 'reading'),
  what it is about (``key``), the ``outcome`` in words and the Holm p-value it rests on (None:
  none, e.g. a reading)."""
  kind: str
  key: str
  outcome: str
  p_holm: float | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Side:
  """What one report decides (`decisions`, keyed by (kind, key)) and where it ran."""
  path: str
  decisions: dict[tuple[str, str], Decision]
  provenance: Provenance | None


def _outcome(verdict: str) -> str:
  """A verdict without its bracketed reason ('undecided (Holm p = 0.6 >= 0.05)' -> 'undecided')."""
  return verdict.split(" (")[0].split(" within ")[0].strip()


def decisions(report: dict, path: str) -> dict[tuple[str, str], Decision]:
  """Every decision of ``report`` (report.json's object, read from ``path``)."""
  out: list[Decision] = []
  for i, row in enumerate(report.get("claims") or ()):
    c = codec.decode(Claim, row, path, f"claims[{i}]")
    out.append(Decision(kind="claim", key=c.claim, outcome=c.verdict,
                        p_holm=c.test.p_holm if c.test else None))
  if report.get("endpoints"):
    e = codec.decode(EndpointsSection, report["endpoints"], path, "endpoints")
    out += [Decision(kind="endpoint", key=f"{t.a} - {t.b}, {t.endpoint}, {t.set}",
                     outcome=_outcome(t.verdict), p_holm=t.p_holm) for t in e.tests]
    if e.equivalence is not None:
      out += [Decision(kind="equivalence", key=f"{t.a} - {t.b}, {t.endpoint} within "
                       f"+-{t.margin:g}, {e.equivalence.set}", outcome=_outcome(t.verdict),
                       p_holm=t.p_holm) for t in e.equivalence.tests]
    if (r := e.readings) is not None:
      out += [Decision(kind="reading", key=f"{r.set}, {r.endpoint}, arm {arm.arm}",
                       outcome=arm.reading) for arm in r.arms]
      out.append(Decision(kind="reading", key=f"{r.set}, {r.endpoint}, survives without "
                          "clipping", outcome="shown" if r.survives_without_clipping else
                          "not shown"))
  keyed = {}
  for d in out:
    if (d.kind, d.key) in keyed:
      raise ValueError(f"{path}: two {d.kind} decisions about {d.key!r}")
    keyed[(d.kind, d.key)] = d
  return keyed


def read(path: str | Path) -> Side:
  """One report.json as a `Side` (ValueError naming the file when it is not a report)."""
  path = Path(path)
  try:
    report = json.loads(path.read_text())
  except (OSError, json.JSONDecodeError) as e:
    raise ValueError(f"{path}: cannot read a report ({e})") from e
  if not isinstance(report, dict) or "claims" not in report:
    raise ValueError(f"{path}: not a report.json (no 'claims' section)")
  prov = report.get("provenance")
  return Side(path=str(path), decisions=decisions(report, str(path)),
              provenance=codec.decode(Provenance, prov, str(path), "provenance") if prov else None)


def _p(p: float | None) -> str:
  return "-" if p is None else f"{p:.3g}"


def _esc(text: str) -> str:
  """Text for a markdown table cell (claims write |x| for absolute values)."""
  return text.replace("|", "\\|")


def _cells(d: Decision | None) -> str:
  """A side's two table cells: the outcome and its Holm p-value ('(absent)' where it has none)."""
  return "(absent) | -" if d is None else f"{_esc(d.outcome)} | {_p(d.p_holm)}"


def _where(p: Provenance | None) -> str:
  if p is None:
    return "no provenance recorded (a report from before issue 62)"
  models = (f"pinned models {p.models.key}" if p.models.source == "pinned"
            else f"models {p.models.source} on it")
  return f"{p.cpu}, {models}, Python {p.python}"


def compare(a: Side, b: Side) -> tuple[list[str], int]:
  """The side-by-side table (markdown lines) and the number of decisions that differ."""
  lines = ["# Decisions of two reports", "",
           f"- A: `{a.path}`: {_where(a.provenance)}", f"- B: `{b.path}`: {_where(b.provenance)}"]
  if a.provenance and b.provenance:
    pa, pb = a.provenance.packages, b.provenance.packages
    moved = [f"{k} {pa.get(k, '-')} / {pb.get(k, '-')}" for k in sorted(set(pa) | set(pb))
             if pa.get(k) != pb.get(k)]
    lines.append(f"- packages that differ (A / B): {', '.join(moved) or 'none'}")
  lines += ["", "| kind | about | A | Holm p | B | Holm p | |", "|---|---|---|--:|---|--:|---|"]
  differ = 0
  for k in list(a.decisions) + [k for k in b.decisions if k not in a.decisions]:
    da, db = a.decisions.get(k), b.decisions.get(k)
    same = da is not None and db is not None and da.outcome == db.outcome
    differ += not same
    lines.append(f"| {k[0]} | {_esc(k[1])} | {_cells(da)} | {_cells(db)} | "
                 f"{'same' if same else '**differs**'} |")
  total = len(set(a.decisions) | set(b.decisions))
  lines += ["", f"{total - differ} of {total} decisions the same, {differ} differ."]
  return lines, differ


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("a", help="report.json of the first run")
  parser.add_argument("b", help="report.json of the second run")
  parser.add_argument("--out", type=Path, help="also write the table to this markdown file")
  args = parser.parse_args(argv)
  try:
    lines, differ = compare(read(args.a), read(args.b))
  except ValueError as e:
    parser.exit(2, f"error: {e}\n")
  text = "\n".join(lines) + "\n"
  if args.out is not None:
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
  print(text, end="")
  return 1 if differ else 0


if __name__ == "__main__":
  raise SystemExit(main())
