"""`disa_jax.pipeline.family`: a Holm family declared in docs/preregistration.md across several
reports, recomputed from their raw p-values; bad declarations named by line; the committed table is
the command's output and the README's decision family holds the 90 tests it draws on."""
import json
from pathlib import Path

import numpy as np
import pytest

from disa_jax import codec
from disa_jax.pipeline import family as F
from disa_jax.pipeline import seed_stats

ROOT = Path(__file__).resolve().parents[2]

DOC = """intro

<!-- family: demo -->
| report | comparison | endpoint | set |
|---|---|---|---|
| r1 | a:b | * | train |
| r2 | `c:d` | kl_auc | * |
<!-- end family -->
"""


def _test(a, b, endpoint, ps, p, diff=-0.1):
  q = min(1.0, 2 * p)
  return {"a": a, "b": b, "endpoint": endpoint, "set": ps, "p": p, "p_holm": q, "diff": diff,
          "n_a": 5, "n_b": 5,
          "verdict": "A lower" if q < 0.05 else f"undecided (Holm p = {q:.3g} >= 0.05)"}


def _reports():
  r1 = {"endpoints": {"tests": [_test("a", "b", "kl_auc", "train", 0.004),
                                _test("a", "b", "steps_to_p90", "train", 0.001, diff=30.0),
                                _test("a", "b", "kl_auc", "heldout", 0.9)]},
        "matched_accuracy_runs": {"a": {"0": {"0.9": {"already_past": False}}},
                                  "b": {"0": {"0.9": {"already_past": True}}, "1": {"0.9": None}}}}
  r2 = {"endpoints": {"tests": [_test("c", "d", "kl_auc", "train", 0.02),
                                _test("c", "d", "kl_auc", "heldout", 0.011)]}}
  return {"r1": F.read_report(r1), "r2": F.read_report(r2)}


def test_one_holm_family_over_the_declared_tests_of_several_reports():
  rows = F.parse_family(DOC, "demo")
  assert [(r.report, r.comparison, r.endpoint, r.set) for r in rows] == [
      ("r1", "a:b", "*", "train"), ("r2", "c:d", "kl_auc", "*")]
  decided = F.decide(F.family_tests(rows, _reports()))
  assert [(t.report, t.test.endpoint, t.test.set) for t in decided] == [
      ("r1", "kl_auc", "train"), ("r1", "steps_to_p90", "train"), ("r2", "kl_auc", "train"),
      ("r2", "kl_auc", "heldout")]  # r1's held-out test is not declared
  np.testing.assert_allclose([t.p_family for t in decided],
                             seed_stats.holm([0.004, 0.001, 0.02, 0.011]))
  v = {(t.report, t.test.endpoint, t.test.set): t for t in decided}
  assert v[("r1", "kl_auc", "train")].verdict_family == "A lower"  # 0.004 x 3 = 0.012
  for ps in ("train", "heldout"):  # 0.011 x 2 = 0.022, then the step-down's maximum
    pooled = v[("r2", "kl_auc", ps)]
    assert pooled.p_family == pytest.approx(0.022) and pooled.verdict_family == "A lower"
    assert not pooled.flipped  # shown by its report's Holm too (0.04, 0.022)
  censored = v[("r1", "steps_to_p90", "train")]  # b's seed 0 was past 0.9 at its first measure
  assert censored.left_censored == {"a": 0, "b": 1} and censored.flipped
  assert censored.flip_cause == "censoring"
  assert censored.verdict_family.startswith("not shown (left-censored runs")
  md = "\n".join(F.markdown("demo", decided))
  assert "Holm over 4 tests from 2 reports; 1 verdicts differ" in md and "(changed)" in md


def test_a_family_that_flips_a_verdict_by_its_size():
  reports = {"r1": {"endpoints": {"tests": [_test("a", "b", "kl_auc", "train", 0.02)]}},
             "r2": {"endpoints": {"tests": [_test("c", "d", "kl_auc", s, 0.5) for s in
                                            ("train", "heldout")]}}}
  reports = {name: F.read_report(r) for name, r in reports.items()}
  doc = DOC.replace("| r1 | a:b | * | train |", "| r1 | a:b | kl_auc | train |")
  decided = F.decide(F.family_tests(F.parse_family(doc, "demo"), reports))
  first = decided[0]  # alone: Holm 0.04 (shown); in 3: 0.06
  assert first.test.verdict == "A lower" and first.p_family == pytest.approx(0.06)
  assert first.flipped and first.flip_cause == "holm"
  assert first.verdict_family == "not shown (Holm p = 0.06 >= 0.05)"


@pytest.mark.parametrize("doc,match", [
    ("no family here", r"no family 'demo'"),
    ("<!-- family: demo -->\n| a | b |\n", r"has no '<!-- end family -->' line"),
    ("<!-- family: demo -->\n| report | pair | endpoint | set |\n<!-- end family -->",
     r":2: family 'demo' needs the columns"),
    ("<!-- family: demo -->\n| report | comparison | endpoint | set |\n| r1 | ab | * | * |\n"
     "<!-- end family -->", r":3: a row needs a report, a comparison 'A:B'"),
    ("<!-- family: demo -->\n| report | comparison | endpoint | set |\n<!-- end family -->",
     r"declares no test"),
])
def test_bad_declarations_are_named(doc, match):
  with pytest.raises(ValueError, match=match):
    F.parse_family(doc, "demo")


def test_rows_must_match_tests_once():
  missing = DOC.replace("| r2 | `c:d` | kl_auc | * |", "| r2 | c:e | kl_auc | * |")
  with pytest.raises(ValueError, match=r"row 7: report 'r2' has no tested c:e / kl_auc / \*"):
    F.family_tests(F.parse_family(missing, "demo"), _reports())
  twice = DOC.replace("| r2 | `c:d` | kl_auc | * |", "| r1 | a:b | kl_auc | train |")
  with pytest.raises(ValueError, match=r"row 7: .* is already in the family \(row 6\)"):
    F.family_tests(F.parse_family(twice, "demo"), _reports())
  with pytest.raises(ValueError, match=r"row 6: no report 'r1'"):
    F.family_tests(F.parse_family(DOC, "demo"), {})


def test_the_readme_decision_family_is_the_committed_table():
  """The declared family covers the 90 tests of the three reports the README's decision
  paragraph draws on, and docs/reports/family_readme_decision.* is the command's output."""
  got = F.run(ROOT / "docs/preregistration.md", "readme_decision", ROOT / "docs/reports")
  assert got.size == 90 and got.flipped_by_holm == 8
  committed = (ROOT / "docs/reports/family_readme_decision.json").read_text()
  assert committed == json.dumps(codec.encode(got), indent=1) + "\n"  # (the bytes, key order too)
  md = (ROOT / "docs/reports/family_readme_decision.md").read_text()
  assert md == "\n".join(F.markdown("readme_decision", got.tests)) + "\n"
