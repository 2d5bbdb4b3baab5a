"""pipeline.compare: two report.json side by side, decision by decision (issue 62: the default
job must decide the same claims on two CPU types)."""
import copy
import json
import pathlib
import re

import pytest

from disa_jax.pipeline import compare

ROOT = pathlib.Path(__file__).resolve().parents[2]
REPORT = ROOT / "docs" / "reports" / "coupling_onpolicy.json"


@pytest.fixture(scope="module")
def report():
  return json.loads(REPORT.read_text())


def _write(tmp_path, name, obj):
  path = tmp_path / name
  path.write_text(json.dumps(obj))
  return path


def test_a_report_against_itself_decides_the_same_everything(report, tmp_path, capsys):
  a = _write(tmp_path, "a.json", report)
  assert compare.main([str(a), str(REPORT), "--out", str(tmp_path / "t.md")]) == 0
  side = compare.read(a)
  kinds = {k for k, _ in side.decisions}
  assert kinds == {"claim", "endpoint", "reading"}
  n = len(side.decisions)
  assert n == (len(report["claims"]) + len(report["endpoints"]["tests"])
               + len(report["endpoints"]["readings"]["arms"]) + 1)  # the arms, survives-unclipped
  assert f"{n} of {n} decisions the same, 0 differ." in capsys.readouterr().out
  assert f"- A: `{a}`: {report['provenance']['cpu']}, pinned models" in (tmp_path / "t.md").read_text()


def test_a_changed_verdict_differs_but_a_changed_reason_or_p_value_does_not(report, tmp_path):
  b = copy.deepcopy(report)
  t0, t1 = b["endpoints"]["tests"][0], b["endpoints"]["tests"][1]
  assert t0["verdict"].startswith("undecided") and t1["verdict"].startswith("undecided")
  t0["verdict"] = "A lower"  # a decision that moved
  t1["verdict"], t1["p_holm"] = "undecided (Holm p = 0.9 >= 0.05)", 0.9  # the same decision
  b["claims"][0]["verdict"] = "does not hold"
  b["provenance"]["cpu"], b["provenance"]["packages"]["jax"] = "Intel Xeon", "0.9.0"
  lines, differ = compare.compare(compare.read(_write(tmp_path, "a.json", report)),
                                  compare.read(_write(tmp_path, "b.json", b)))
  assert differ == 2
  flagged = [ln for ln in lines if ln.endswith("**differs** |")]
  assert len(flagged) == 2
  assert any(f"{t0['a']} - {t0['b']}, {t0['endpoint']}, {t0['set']}" in ln and "A lower" in ln
             for ln in flagged)
  assert any("does not hold" in ln for ln in flagged)
  assert any(ln.startswith("- B:") and "Intel Xeon" in ln for ln in lines)
  assert any("jax 0.10.2 / 0.9.0" in ln for ln in lines)
  assert compare.main([str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 1


def test_a_decision_one_report_lacks_counts_as_a_difference(report, tmp_path):
  b = copy.deepcopy(report)
  dropped = b["endpoints"]["tests"].pop()
  lines, differ = compare.compare(compare.read(_write(tmp_path, "a.json", report)),
                                  compare.read(_write(tmp_path, "b.json", b)))
  assert differ == 1
  row = next(ln for ln in lines if "(absent)" in ln)
  assert f"{dropped['a']} - {dropped['b']}" in row and row.endswith("**differs** |")


def test_claim_text_with_bars_stays_one_table_cell(report, tmp_path):
  b = copy.deepcopy(report)
  b["claims"][0]["claim"] = "|log Z_IS - log Z| shrinks"
  lines, _ = compare.compare(compare.read(_write(tmp_path, "b.json", b)),
                             compare.read(_write(tmp_path, "c.json", b)))
  row = next(ln for ln in lines if "log Z_IS" in ln)
  assert "\\|log Z_IS - log Z\\|" in row and len(re.split(r"(?<!\\)\|", row)) == 9  # 7 cells


def test_what_is_not_a_report_is_refused_naming_the_file_and_field(report, tmp_path, capsys):
  bad = _write(tmp_path, "notes.json", {"hello": 1})
  with pytest.raises(SystemExit) as e:
    compare.main([str(bad), str(REPORT)])
  assert e.value.code == 2 and "notes.json: not a report.json" in capsys.readouterr().err
  b = copy.deepcopy(report)
  b["claims"][0]["verdict"] = 3
  with pytest.raises(ValueError, match=r"broken.json.*claims\[0\].*verdict"):
    compare.read(_write(tmp_path, "broken.json", b))
  (tmp_path / "cut.json").write_text(json.dumps(report)[:500])
  with pytest.raises(ValueError, match="cut.json: cannot read a report"):
    compare.read(tmp_path / "cut.json")


def test_equivalence_tests_are_decisions_with_their_margin():
  side = compare.read(ROOT / "docs" / "reports" / "coupling_offpolicy_quick.json")
  eq = [d for (kind, _), d in side.decisions.items() if kind == "equivalence"]
  raw = json.loads((ROOT / "docs" / "reports" / "coupling_offpolicy_quick.json").read_text())
  assert len(eq) == len(raw["endpoints"]["equivalence"]["tests"]) > 0
  t = raw["endpoints"]["equivalence"]["tests"][0]
  d = side.decisions[("equivalence", f"{t['a']} - {t['b']}, {t['endpoint']} within "
                      f"+-{t['margin']:g}, train")]
  assert d.outcome in ("shown equivalent", "equivalence not shown", "not tested")
  assert d.outcome == t["verdict"].split(" (")[0].split(" within ")[0]
