"""`disa_jax.pipeline.across_builds`: one design's reports on several π_ref builds read by the
intersection-union rule; builds that do not share the design are refused by name; the committed
tables are the command's output."""
import json
from pathlib import Path

import pytest

from configs import coupling
from disa_jax import codec
from disa_jax.pipeline import across_builds as X
from disa_jax.pipeline.report_records import EndpointTest

ROOT = Path(__file__).resolve().parents[2]


def _t(a, b, endpoint, ps, p_holm, diff, method="welch"):
  return EndpointTest(a=a, b=b, endpoint=endpoint, set=ps, p=p_holm / 2, p_holm=p_holm,
                      diff=diff, n_a=5, n_b=5, method=method)


def _build(*rows):
  keys = [("x", "y", "kl_auc", "train"), ("x", "y", "kl_auc", "heldout"),
          ("x", "z", "kl_auc", "train"), ("x", "z", "steps_to_p90", "train")]
  return [_t(*k, p, d, "gehan" if k[2] == "steps_to_p90" else "welch")
          for k, (p, d) in zip(keys, rows)]


def test_a_difference_is_shown_only_where_every_build_shows_it_in_one_direction():
  one = _build((0.01, 0.3), (0.01, 0.3), (0.01, -0.2), (0.2, 0.5))
  two = _build((0.001, 0.5), (0.30, 0.2), (0.02, 0.1), (0.04, -0.6))
  got = X.read_across("demo", {"b1": one, "b2": two})
  readings = [(t.reading, t.direction) for t in got.tests]
  assert readings == [(X.SHOWN_ALL, "A higher"), (X.SHOWN_SOME, "A higher"), (X.OPPOSITE, ""),
                      (X.SHOWN_SOME, "A earlier")]
  assert got.counts == {X.SHOWN_ALL: 1, X.SHOWN_SOME: 2, X.OPPOSITE: 1, X.NOT_SHOWN: 0}
  assert [b.report for b in got.tests[0].builds] == ["b1", "b2"]
  three = _build((0.06, 0.5), (0.9, 0.1), (0.5, 0.1), (0.7, 0.1))
  got3 = X.read_across("demo", {"b1": one, "b2": two, "b3": three})
  assert [t.reading for t in got3.tests] == [X.SHOWN_SOME, X.SHOWN_SOME, X.OPPOSITE, X.SHOWN_SOME]
  none = X.read_across("demo", {"b2": three, "b3": three})
  assert none.counts[X.NOT_SHOWN] == 4


def test_builds_that_do_not_share_the_design_are_refused_by_name():
  one = _build((0.01, 0.3), (0.01, 0.3), (0.01, -0.2), (0.2, 0.5))
  with pytest.raises(ValueError, match=r"report 'b2' lacks the test x - z / steps_to_p90 / train"):
    X.read_across("demo", {"b1": one, "b2": one[:3]})
  with pytest.raises(ValueError, match=r"report 'b1' lacks the test x - y / kl_auc / train"):
    X.read_across("demo", {"b1": one[1:], "b2": one})
  with pytest.raises(ValueError, match=r"needs the reports of 2 or more builds, got \['b1'\]"):
    X.read_across("demo", {"b1": one})
  with pytest.raises(ValueError, match=r"report 'b2' has no endpoint tests"):
    X.read_across("demo", {"b1": one, "b2": []})


def test_a_declared_sub_design_reads_only_its_comparisons_which_every_build_must_hold(tmp_path):
  whole = _build((0.01, 0.3), (0.01, 0.3), (0.01, -0.2), (0.2, 0.5))
  part = [t for t in _build((0.001, 0.5), (0.30, 0.2), (0.02, 0.1), (0.04, -0.6)) if t.b == "z"]
  got = X.read_across("demo", {"b1": whole, "b2": part}, compare=("x:z",))
  assert [(t.b, t.endpoint, t.reading) for t in got.tests] == [
      ("z", "kl_auc", X.OPPOSITE), ("z", "steps_to_p90", X.SHOWN_SOME)]
  assert got.tests[1].builds[1].p_holm == 0.04  # each build's own family's Holm p
  assert got.compare == ("x:z",)
  assert "Only the comparisons `x:z` are read" in X.markdown(got)[0]
  assert "compare" in codec.encode(got)
  assert "compare" not in codec.encode(X.read_across("demo", {"b1": whole, "b2": whole}))
  with pytest.raises(ValueError, match=r"report 'b2' has no test of the comparison x:y"):
    X.read_across("demo", {"b1": whole, "b2": part}, compare=("x:y", "x:z"))
  with pytest.raises(ValueError, match=r"report 'b2' lacks the test x - y / kl_auc / heldout"):
    X.read_across("demo", {"b1": whole, "b2": part})  # the whole design: still refused
  with pytest.raises(ValueError, match=r"compare entry 'x-z' is not 'A:B'"):
    X.read_across("demo", {"b1": whole, "b2": part}, compare=("x-z",))


def test_the_command_names_a_missing_report(tmp_path, capsys):
  with pytest.raises(SystemExit) as e:
    X.main(["--name", "d", "--reports", "a", "b", "--reports-dir", str(tmp_path)])
  assert e.value.code == 2 and f"no report {tmp_path / 'a.json'}" in capsys.readouterr().err


# The on-policy block's declared comparisons but the fitted anchor against the exact log Z (decided
# on build 2 in their own family: the coupling_onpolicy_anchor table).
ONPOLICY_REST = tuple(
    p for p in coupling.onpolicy_compare(tuple(f"{cell}_{clip}" for cell in coupling.ONPOLICY_CELLS
                                               for clip in coupling.CLIPS))
    if p not in {f"disa_{clip}:disa_exact_{clip}" for clip in coupling.CLIPS})


@pytest.mark.parametrize("name,reports,compare,shown_all,shown_some", [
    ("anchor_testbed_rl", ("anchor_testbed_rl", "anchor_testbed_rl_build2"), (), 5, 1),
    ("anchor_testbed_offpolicy", ("anchor_testbed_offpolicy", "anchor_testbed_offpolicy_build2"),
     (), 11, 3),
    ("anchor_testbed_offpolicy_mean",
     ("anchor_testbed_offpolicy_mean", "anchor_testbed_offpolicy_mean_build2"), (), 4, 4),
    ("coupling_onpolicy_anchor", ("coupling_onpolicy", "coupling_onpolicy_anchor_build2"),
     ("disa_c1:disa_exact_c1", "disa_c0:disa_exact_c0"), 0, 0),
    ("coupling_offpolicy_k0", ("coupling_offpolicy", "coupling_offpolicy_k0_build2"),
     ("k0_u4_disa:k0_u4_flowrl_paper", "k0_u4_disa:k0_u4_vargrad"), 6, 2),
    ("coupling_offpolicy_k2", ("coupling_offpolicy", "coupling_offpolicy_k2_build2"),
     ("k2_u4_disa:k2_u4_flowrl_paper", "k2_u4_disa:k2_u4_vargrad"), 15, 1),
    ("coupling_onpolicy_rest", ("coupling_onpolicy", "coupling_onpolicy_rest_build2"),
     ONPOLICY_REST, 4, 9)])
def test_the_committed_tables_are_the_commands_output(name, reports, compare, shown_all,
                                                      shown_some):
  """docs/reports/across_builds_<name>.* is what the command writes from the committed reports
  (the README's across-builds sentences read it)."""
  got = X.run(name, reports, ROOT / "docs/reports", compare)
  assert (got.counts[X.SHOWN_ALL], got.counts[X.SHOWN_SOME]) == (shown_all, shown_some)
  if compare:  # the sub-design's comparisons x 4 endpoints x 2 prompt sets
    assert len(got.tests) == 8 * len(compare)
  stem = ROOT / "docs/reports" / f"across_builds_{name}"
  assert stem.with_suffix(".json").read_text() == json.dumps(codec.encode(got), indent=1) + "\n"
  assert stem.with_suffix(".md").read_text() == "\n".join(X.markdown(got)) + "\n"
