"""`disa_jax.pipeline.endpoints`: the pre-registered endpoints of one run on analytic curves, the
comparisons (Welch, Holm over the family, undecided with a reason), the declared pairs, and the
series of the held-out prompts read back from a metrics file."""
import json
from pathlib import Path

import numpy as np
import pytest

from configs import main as main_config
from disa_jax import codec
from disa_jax.pipeline import censored as CZ
from disa_jax.pipeline import endpoints as EP
from disa_jax.pipeline import step_size as SZ
from disa_jax.pipeline import seed_stats
from disa_jax.pipeline.job_config import MainConfig
from disa_jax.workflows.stage3 import SERIES_FIELDS, ExactSeries


def _series(steps, kl, p, kl_correct=None):
  n = len(steps)
  fields = {f: np.zeros(n) for f in SERIES_FIELDS}
  fields.update(kl_decomposed=np.asarray(kl, float), p_correct=np.asarray(p, float),
                kl_correct=np.asarray(kl_correct if kl_correct is not None else np.zeros(n), float))
  return ExactSeries(step=np.asarray(steps, np.int64), **fields)


def test_area_under_the_kl_curve_is_the_mean_kl_over_the_measured_steps():
  flat = EP.run_endpoints(_series([10, 20, 40], [2.0, 2.0, 2.0], [0.1] * 3))
  assert flat.kl_auc == pytest.approx(2.0)
  line = EP.run_endpoints(_series([0, 50, 100], [4.0, 2.0, 0.0], [0.1] * 3))
  assert line.kl_auc == pytest.approx(2.0)  # a straight line 4 -> 0: mean 2
  # trapezoids on uneven steps: (3 + 1) / 2 x 10 + (1 + 1) / 2 x 30 over 40 steps
  uneven = EP.run_endpoints(_series([0, 10, 40], [3.0, 1.0, 1.0], [0.1] * 3, [0.5, 0.4, 0.25]))
  assert uneven.kl_auc == pytest.approx((20 + 30) / 40)
  assert uneven.kl_correct_end == 0.25 and uneven.measurements == 3
  assert (uneven.first_step, uneven.last_step) == (0, 40)


def test_steps_to_p90_interpolates_the_first_crossing_and_censors_runs_that_never_cross():
  crossing = EP.run_endpoints(_series([0, 10, 20, 30], [1] * 4, [0.5, 0.8, 1.0, 0.85]))
  assert crossing.steps_to_p90 == pytest.approx(15.0) and not crossing.censored
  never = EP.run_endpoints(_series([0, 10, 20], [1] * 3, [0.5, 0.8, 0.89]))
  assert never.steps_to_p90 == 20.0 and never.censored
  assert (crossing.p90_low, crossing.p90_high, crossing.p90_kind) == (10, 20, "interval")
  assert (never.p90_low, never.p90_high, never.p90_kind) == (20, None, "right")
  past = EP.run_endpoints(_series([16, 32], [1] * 2, [0.95, 0.97]))
  assert past.steps_to_p90 == 16.0 and not past.censored and past.left_censored
  assert (past.p90_low, past.p90_high, past.p90_kind) == (0, 16, "left")
  at_start = EP.run_endpoints(_series([0, 16], [1] * 2, [0.95, 0.97]))
  assert at_start.p90_kind == "exact" and not at_start.left_censored
  with pytest.raises(ValueError, match=r"increasing steps, got steps \[10, 10\]"):
    EP.run_endpoints(_series([10, 10], [1, 1], [0.5, 0.5]))


def _runs(rng, kl_mean, n=5, reach=100.0, censored=()):
  out = []
  for i in range(n):
    t = reach + 5 * rng.normal()
    when = (CZ.Interval(200.0, np.inf, "right") if i in censored else
            CZ.Interval(10 * np.floor(t / 10), 10 * np.floor(t / 10) + 10, "interval"))
    out.append(EP.RunEndpoints(kl_auc=kl_mean + 0.05 * rng.normal(),
                               kl_correct_end=0.3 + 0.05 * rng.normal(),
                               steps_to_p90=t, censored=i in censored, left_censored=False,
                               p90_low=when.low, p90_high=None if i in censored else when.high,
                               p90_kind=when.kind, measurements=3, first_step=0, last_step=200,
                               seed=i))
  return out


def test_the_section_tests_each_declared_pair_and_corrects_over_the_family():
  rng = np.random.default_rng(0)
  per = {"train": {"a": _runs(rng, 1.0), "b": _runs(rng, 2.0), "c": _runs(rng, 1.0, censored=(2,)),
                   "d": _runs(rng, 1.0, n=1)}}
  sec = EP.section(per, [("a", "b"), ("a", "c"), ("a", "d")])
  tests = {(t.b, t.endpoint): t for t in sec.tests}
  assert len(sec.tests) == 9 and sec.family == 6  # a:d not testable
  kl = tests[("b", "kl_auc")]
  want = seed_stats.welch([r.kl_auc for r in per["train"]["a"]],
                          [r.kl_auc for r in per["train"]["b"]])
  assert kl.p == pytest.approx(want.p) and kl.diff == pytest.approx(want.diff)
  assert kl.verdict == "A lower" and kl.p_holm >= kl.p
  raw = [t.p for t in sec.tests if t.p is not None]
  np.testing.assert_allclose([t.p_holm for t in sec.tests if t.p is not None],
                             seed_stats.holm(raw))
  steps = tests[("c", "steps_to_p90")]  # a censored run: Gehan's test, not Welch's
  assert steps.method == "gehan" and steps.kinds[1]["right"] == 1 and steps.p > 0.05
  assert tests[("d", "kl_auc")].verdict == "undecided (5 / 1 seeds (a test needs >= 2 a side))"
  same = tests[("c", "kl_correct_end")]
  assert same.verdict.startswith("undecided (Holm p = ")  # both at 0.3: no difference shown
  cell = sec.cells["train"]["c"]
  assert cell.seeds == 5 and cell.censored == 1
  assert cell.kl_auc.ci_low < cell.kl_auc.mean < cell.kl_auc.ci_high
  assert sec.cells["train"]["d"].kl_auc.ci_low is None
  md = "\n".join(EP.markdown(sec))
  assert "| `a` - `b` | train | kl_auc |" in md and "Holm over the 6 tests run" in md
  assert "Gehan's permutation test" in md and "| never reached / already past |" in md


def test_left_censored_runs_are_compared_by_gehans_test_not_welchs():
  """Every comparator run already past P(correct) 0.9 at its first measurement (step 40, the
  off-policy reports' pattern): the old Welch test saw five equal values."""
  steps = [40, 80, 120, 160]
  disa = [EP.run_endpoints(_series(steps, [1] * 4, p)) for p in
          ([0.5, 0.95, 0.97, 0.98], [0.6, 0.92, 0.97, 0.98], [0.5, 0.8, 0.91, 0.98],
           [0.7, 0.93, 0.97, 0.98], [0.5, 0.85, 0.95, 0.98])]
  fast = [EP.run_endpoints(_series(steps, [1] * 4, [0.93 + 0.01 * i, 0.97, 0.98, 0.99]))
          for i in range(5)]
  sec = EP.section({"train": {"disa": disa, "vargrad": fast}}, [("disa", "vargrad")])
  t = next(t for t in sec.tests if t.endpoint == "steps_to_p90")
  assert t.method == "gehan" and t.p == pytest.approx(2 / 252) and t.diff == 1.0
  assert t.kinds[1]["left"] == 5 and t.verdict == "A later"  # Holm over 3: 0.024
  assert sec.cells["train"]["vargrad"].left_censored == 5


def test_declared_pairs_are_checked_against_the_methods():
  cfg = EP.EndpointsConfig(compare=("disa:flowrl",))
  assert cfg.pairs(("disa", "flowrl")) == [("disa", "flowrl")]
  with pytest.raises(ValueError, match=r"endpoints.compare\[0\]='disa:gspo': 'gspo' is not in"):
    EP.EndpointsConfig(compare=("disa:gspo",)).pairs(("disa", "flowrl"))
  with pytest.raises(ValueError, match=r"endpoints.compare\[1\] must be 'A:B'.*got 'disa<flowrl'"):
    EP.EndpointsConfig(compare=("disa:flowrl", "disa<flowrl")).pairs(("disa", "flowrl"))


@pytest.mark.parametrize("field,value,match", [
    ("endpoints.compare", ("disa:nope",), "'nope' is not in methods"),
    ("track.heldout", True, r"track.heldout=True .* needs heldout.fraction > 0, got 0.0"),
])
def test_the_job_config_refuses_endpoints_it_cannot_compute(field, value, match):
  c = main_config.get_config()
  section, name = field.split(".")
  c[section][name] = value
  with pytest.raises(ValueError, match=match):
    MainConfig.from_config(c)


class _Run:
  def __init__(self, path: Path):
    self.metrics_path = path

  def metrics(self):
    return [json.loads(line) for line in self.metrics_path.open()]

  def exact_series(self, prefix):
    return ExactSeries.from_rows(self.metrics(), self.metrics_path, prefix)


def test_collect_reads_the_training_and_the_held_out_measures_of_each_run(tmp_path):
  rows = []
  for step in (1, 2, 3, 4):
    row = {"step": step, "loss": 1.0}
    if step % 2 == 0:
      for prefix, p in (("exact", 0.45 * step / 2), ("exact_heldout", 0.3 * step / 2)):
        row |= {f"{prefix}/{f}": 0.0 for f in SERIES_FIELDS}
        row |= {f"{prefix}/p_correct": p, f"{prefix}/kl_decomposed": 1.0 / step}
    rows.append(row)
  path = tmp_path / "metrics.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  got = EP.collect({("disa", 0): _Run(path), ("disa", 1): _Run(tmp_path / "missing.jsonl")},
                   {"disa": (0, 1), "flowrl": (0,)})
  assert set(got) == {"train", "heldout"} and list(got["train"]) == ["disa"]
  train, held = got["train"]["disa"], got["heldout"]["disa"]
  assert len(train) == 1 and train[0].seed == 0
  assert train[0].steps_to_p90 == 4.0 and not train[0].censored  # 0.45, 0.9
  assert held[0].censored and held[0].kl_auc == pytest.approx((0.5 + 0.25) / 2)
  only_train = [{k: v for k, v in r.items() if not k.startswith("exact_heldout/")} for r in rows]
  path.write_text("".join(json.dumps(r) + "\n" for r in only_train))
  assert set(EP.collect({("disa", 0): _Run(path)}, {"disa": (0,)})) == {"train"}


def _metrics(path: Path, p_correct) -> _Run:
  rows = [{"step": 40 * (i + 1), **{f"exact/{f}": 0.0 for f in SERIES_FIELDS},
           "exact/p_correct": p} for i, p in enumerate(p_correct)]
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return _Run(path)


def test_stability_needs_the_level_at_the_end_and_the_floor_throughout():
  good = SZ.stability(_series([40, 80, 120], [1] * 3, [0.2, 0.6, 0.91]), 0.9, 0.153)
  assert good.stable and good.p_last == 0.91 and good.p_min == 0.2
  dipped = SZ.stability(_series([40, 80, 120], [1] * 3, [0.2, 0.1, 0.95]), 0.9, 0.153)
  assert not dipped.stable and (dipped.p_min, dipped.p_min_step) == (0.1, 80)
  short = SZ.stability(_series([40, 80], [1] * 2, [0.5, 0.899]), 0.9, 0.153)
  assert not short.stable
  assert SZ.stability(_series([40], [1], [0.9]), 0.9, 0.153).stable  # the level itself counts


def test_the_pilot_picks_the_largest_stable_lr_and_waits_for_missing_runs(tmp_path):
  stage3 = {("lr3em4", 0): _metrics(tmp_path / "a.jsonl", [0.3, 0.95, 0.12, 0.92]),  # a collapse
            ("lr1em4", 0): _metrics(tmp_path / "b.jsonl", [0.2, 0.7, 0.93]),
            ("lr3em5", 0): _metrics(tmp_path / "c.jsonl", [0.16, 0.4, 0.91])}
  runs = {"lr3em4": (3e-4, (0,)), "lr1em4": (1e-4, (0,)), "lr3em5": (3e-5, (0,))}
  rule = EP.EndpointsConfig(stable_level=0.9, stable_floor=0.153)
  sec = SZ.step_size_section(stage3, runs, rule)
  assert sec.chosen == 1e-4 and sec.chosen_run == "lr1em4"
  assert [r.stable for r in sec.runs] == [False, True, True]
  assert sec.verdict == "lr 0.0001 (lr1em4): the largest stable"
  md = "\n".join(SZ.step_size_markdown(sec))
  assert "| `lr3em4` | 0 | 0.0003 | 0.920 | 0.120 (120) | no |" in md
  none = SZ.step_size_section(stage3, {"lr3em4": runs["lr3em4"]}, rule)
  assert none.chosen is None and none.verdict.startswith("no lr is stable")
  missing = SZ.step_size_section(stage3, runs | {"lr1em3": (1e-3, (0,))}, rule)
  assert missing.chosen is None  # a larger lr not yet measured could be the stable one
  assert missing.verdict == "undecided: not measured: lr1em3 (seed 0)"


def test_the_pilot_rule_is_checked():
  with pytest.raises(ValueError, match=r"endpoints.step_size\[1\]='nope' is not in methods"):
    EP.EndpointsConfig(step_size=("disa", "nope")).pilot_runs(("disa",))
  with pytest.raises(ValueError, match=r"stable_floor < stable_level.*stable_floor=0.95"):
    EP.EndpointsConfig(stable_floor=0.95)
  cfg = MainConfig.from_config(main_config.get_config("anchor_testbed_offpolicy_pilot"))
  assert cfg.endpoints.pilot_runs(cfg.methods) == cfg.methods and len(cfg.methods) == 3
  assert (cfg.endpoints.stable_level, cfg.endpoints.stable_floor) == (0.9, 0.153)


def test_the_section_read_back_from_report_json_draws_the_same_tables():
  """report.md is drawn from report.json: the section encoded, read back as its records (the
  cells: a mapping of mappings of `EndpointCell`) and drawn again gives the same lines."""
  rng = np.random.default_rng(1)
  sec = EP.section({"train": {"a": _runs(rng, 1.0), "b": _runs(rng, 2.0, censored=(1,))}},
                   [("a", "b")])
  text = json.dumps({"endpoints": codec.encode(sec)}, indent=1, default=float)
  back = codec.decode(EP.EndpointsSection, json.loads(text)["endpoints"], "report.json",
                      "endpoints")
  assert back == sec and EP.markdown(back) == EP.markdown(sec)
  assert isinstance(back.cells["train"]["b"], EP.EndpointCell)


def test_kl_end_is_the_mean_kl_over_the_last_quarter_of_the_measured_steps():
  r = EP.run_endpoints(_series([0, 20, 40, 60, 80], [5.0, 4.0, 3.0, 2.0, 1.0], [0.1] * 5))
  assert r.kl_end == pytest.approx(1.5)  # steps 60 and 80 (>= 80 - 0.25 x 80)


def _units(values, kind="interval", low=40.0, high=80.0):
  return [EP.RunEndpoints(kl_auc=v, kl_correct_end=v / 2, kl_end=v, steps_to_p90=60.0,
                          censored=kind == "right", left_censored=kind == "left", p90_low=low,
                          p90_high=None if kind == "right" else high, p90_kind=kind,
                          measurements=3, first_step=0, last_step=600, seed=i)
          for i, v in enumerate(values)]


def test_a_replicated_cell_is_tested_over_replica_means_not_over_seeds():
  """Ten seeds nested in two replicas count as two units: the replica effect (1.0 vs 2.0) leaves
  the difference to a comparator undecided, while the same ten values taken as seeds decide it."""
  train = {"cell": _units([1.0, 1.01, 0.99, 1.0, 1.0]),
           "cell_rep1": _units([2.0, 2.01, 1.99, 2.0, 2.0]),
           "other": _units([0.5, 0.52, 0.48, 0.51, 0.49])}
  reps = {"cell": ("cell", "cell_rep1")}
  assert [u.kl_auc for u in EP.units(train, "cell", reps)] == pytest.approx([1.0, 2.0])
  over_reps = EP.section({"train": train}, [("cell", "other")], replicas=reps)
  t = next(x for x in over_reps.tests if x.endpoint == "kl_auc")
  assert t.n_a == 2 and t.verdict.startswith("undecided")
  pooled = {"cell": train["cell"] + train["cell_rep1"], "other": train["other"]}
  t2 = next(x for x in EP.section({"train": pooled}, [("cell", "other")]).tests
            if x.endpoint == "kl_auc")
  assert t2.n_a == 10 and t2.verdict == "A higher"
  assert over_reps.replica_cells["train"]["cell"].seeds == 2
  md = "\n".join(EP.markdown(over_reps))
  assert "Cells over anchor replicas" in md and "| `cell` | train | 2 |" in md


def test_a_replica_units_steps_interval_is_the_mean_of_its_seeds_bounds():
  u = EP.replica_unit(_units([1.0], low=40, high=80) + _units([1.0], low=0, high=10, kind="left"))
  assert (u.p90_low, u.p90_high, u.p90_kind) == (20.0, 45.0, "interval")
  r = EP.replica_unit(_units([1.0]) + _units([1.0], kind="right", low=600))
  assert r.p90_kind == "right" and r.p90_high is None and r.censored
  with pytest.raises(ValueError, match="replica_unit needs >= 1 run"):
    EP.replica_unit([])


def test_equivalence_is_shown_only_inside_the_declared_margin():
  a = _units([1.00, 1.02, 0.98, 1.01, 0.99, 1.0, 1.0, 1.01, 0.99, 1.0])
  b = _units([1.01, 1.03, 0.99, 1.0, 1.0, 1.01, 0.99, 1.02, 1.0, 1.01])
  eq = EP.equivalence_tests({"a": a, "b": b}, [("a", "b")], {"kl_auc": 0.11}, {})
  assert eq.family == 1 and eq.tests[0].verdict == "shown equivalent within +-0.11"
  tight = EP.equivalence_tests({"a": a, "b": b}, [("a", "b")], {"kl_auc": 0.001}, {})
  assert tight.tests[0].verdict.startswith("equivalence not shown")
  far = EP.equivalence_tests({"a": a, "b": _units([1.5] * 5 + [1.6] * 5)}, [("a", "b")],
                             {"kl_auc": 0.11}, {})
  assert far.tests[0].verdict.startswith("equivalence not shown")
  one = EP.equivalence_tests({"a": a[:1], "b": b}, [("a", "b")], {"kl_auc": 0.11}, {})
  assert one.family == 0 and one.tests[0].verdict.startswith("not tested")
  sec = EP.section({"train": {"a": a, "b": b}}, [("a", "b")], equivalence=[("a", "b")],
                   rule=EP.EndpointsConfig(margins={"kl_auc": 0.11}))
  assert "### Equivalence (TOST on the train prompts" in "\n".join(EP.markdown(sec))
  back = codec.decode(EP.EndpointsSection, json.loads(json.dumps(codec.encode(sec),
                                                                 default=float)), "r", "e")
  assert back == sec  # the new parts round-trip through report.json


def test_the_endpoints_rule_refuses_bad_margins_and_endpoints():
  with pytest.raises(ValueError, match=r"endpoints.endpoints: 'kl_max' is not one of"):
    EP.EndpointsConfig(endpoints=("kl_auc", "kl_max"))
  with pytest.raises(ValueError, match=r"margins\['steps_to_p90'\]=5"):
    EP.EndpointsConfig(margins={"steps_to_p90": 5})
  with pytest.raises(ValueError, match=r"margins\['kl_auc'\]=0"):
    EP.EndpointsConfig(margins={"kl_auc": 0})
  with pytest.raises(ValueError, match=r"equivalence=\('a:b',\) needs endpoints.margins"):
    EP.EndpointsConfig(equivalence=("a:b",))
  with pytest.raises(ValueError, match=r"endpoints.equivalence\[0\]='a:c': 'c' is not in"):
    EP.EndpointsConfig(equivalence=("a:c",), margins={"kl_auc": 0.1}).equivalence_pairs(("a",))


def test_a_pilot_of_several_groups_picks_one_lr_per_group(tmp_path):
  stage3 = {("x_c1_lr3em4", 0): _metrics(tmp_path / "a.jsonl", [0.3, 0.95]),
            ("x_c1_lr1em4", 0): _metrics(tmp_path / "b.jsonl", [0.2, 0.93]),
            ("x_c0_lr3em4", 0): _metrics(tmp_path / "c.jsonl", [0.3, 0.1, 0.95]),  # a collapse
            ("x_c0_lr1em4", 0): _metrics(tmp_path / "d.jsonl", [0.2, 0.5])}  # not there
  runs = {name: (3e-4 if name.endswith("3em4") else 1e-4, (0,)) for name, _ in stage3}
  rule = EP.EndpointsConfig(stable_floor=0.153)
  sec = SZ.step_size_section(stage3, runs, rule)
  assert sec.groups["x_c1"].chosen == 3e-4 and sec.groups["x_c0"].chosen is None
  assert sec.chosen is None and sec.verdict == "1 of 2 groups have a stable lr"
  md = "\n".join(SZ.step_size_markdown(sec))
  assert "| `x_c1` | 0.0003 | lr 0.0003 (x_c1_lr3em4): the largest stable |" in md
  assert [SZ.pilot_group(n) for n in ("lr3em4", "u4_exact_lr3em4", "d_c0_lr1em3")] == [
      "", "u4_exact", "d_c0"]
  # run from the largest lr down: a stable largest lr decides its group without the smaller ones
  top = {k: v for k, v in stage3.items() if k[0] != "x_c1_lr1em4"}
  assert SZ.step_size_section(top, runs, rule).groups["x_c1"].chosen == 3e-4
  # ... but a missing larger lr leaves it undecided
  low = {k: v for k, v in stage3.items() if k[0] != "x_c1_lr3em4"}
  assert SZ.step_size_section(low, runs, rule).groups["x_c1"].verdict == (
      "undecided: not measured: x_c1_lr3em4 (seed 0)")


def test_step_logs_average_each_seed_over_training_then_over_seeds(tmp_path):
  def run(name, values):
    path = tmp_path / f"{name}.jsonl"
    path.write_text("".join(json.dumps({"step": i + 1, "tb_residual_mean": v, "grad_norm": 10 * v,
                                        "grad_clipped_share": 1.0}) + "\n"
                            for i, v in enumerate(values)))
    return _Run(path)
  stage3 = {("a", 0): run("a0", [1.0, 3.0]), ("a", 1): run("a1", [4.0, 6.0])}
  logs = EP.step_logs(stage3, {"a": (0, 1), "b": (0,)})
  assert list(logs) == ["a"] and logs["a"].seeds == 2
  assert logs["a"].tb_residual_mean.mean == pytest.approx(3.5)  # (2 + 5) / 2
  assert logs["a"].grad_clipped_share.mean == 1.0
