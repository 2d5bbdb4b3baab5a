"""`pipeline.grid`: the regime table's figures over seeds and the KL-against-sigma_g curve, on
made-up runs whose answers are known."""
import json
import math
from pathlib import Path

import pytest

from configs import main as main_config
from disa_jax import codec
from disa_jax.pipeline import grid as G
from disa_jax.pipeline import tables
from disa_jax.pipeline.job_config import MainConfig
from disa_jax.pipeline.plan import job_plan
from disa_jax.pipeline.report_records import FigureSummary, RunFigures


def test_summary_is_the_mean_sample_std_and_the_student_t_interval():
  s = G.summary([1.0, 2.0, 3.0])
  half = 4.302652729911275 / math.sqrt(3.0)  # t_{0.975, 2} x std 1 / sqrt(3)
  assert s.mean == 2.0 and s.std == 1.0 and s.n == 3
  assert s.ci95 == pytest.approx((2.0 - half, 2.0 + half), rel=1e-9)
  assert G.summary([5.0]) == FigureSummary(mean=5.0, std=0.0, ci95=None, n=1)
  assert G.summary([None, float("nan")]).n == 0


def test_the_window_keeps_the_last_fifth_of_training_rows_only():
  rows = [{"step": s, "grad_norm": float(s), "loss": 10.0 * s} for s in range(1, 101)]
  rows += [{"step": 100, "exact/kl_mc": 0.3}]  # a measure row: no gradient, skipped
  assert G.WINDOW == G.dynamics.EndStateConfig().window  # the end-state rule's window by default
  got = G.window_means(rows, 100, window=0.2)
  assert got["grad_sq"] == pytest.approx(sum(s * s for s in range(81, 101)) / 20)
  assert got["grad_sq_median"] == pytest.approx((90 ** 2 + 91 ** 2) / 2)
  assert got["loss"] == pytest.approx(10.0 * sum(range(81, 101)) / 20)
  with pytest.raises(ValueError, match="no training row with grad_norm and loss after step 80"):
    G.window_means(rows[:50], 100, window=0.2)


def test_run_figures_count_the_seeds_that_reached_the_accuracy_level():
  seeds = [G.SeedFigures(seed=0, kl=0.2, kl_mc=0.25, kl_correct=0.1, steps_to_level=64,
                         grad_sq=4.0, grad_sq_median=3.0, loss=1.0),
           G.SeedFigures(seed=1, kl=0.4, kl_mc=0.5, kl_correct=0.3, steps_to_level=None,
                         grad_sq=6.0, grad_sq_median=5.0, loss=2.0)]
  f = G.run_figures({"a": seeds})["a"]
  assert f.seeds == 2 and f.reached == 1 and f.steps_to_level.mean == 64
  assert f.kl.mean == pytest.approx(0.3) and f.grad_sq.std == pytest.approx(math.sqrt(2))
  assert f.kl_mc.mean == pytest.approx(0.375)
  assert f.loss_first_seed == 1.0
  assert list(codec.encode(f))[:3] == ["seeds", "reached", "steps_to_0.9"]  # (one key, 3rd)


def _plan(preset="anchor_study_rl"):
  return job_plan(MainConfig.from_config(main_config.get_config(preset)), "/tmp/unused")


def _fig(kl, loss, seeds=3, ci95=None, kl_mc=None):
  one = lambda v, ci=None: {"mean": v, "std": 0.1 if seeds > 1 else 0.0, "ci95": ci, "n": seeds}
  fig = {"seeds": seeds, "reached": seeds, "kl": one(kl, ci95), "kl_correct": one(kl / 2),
         "steps_to_0.9": one(100.0), "grad_sq": one(50.0), "grad_sq_median": one(20.0),
         "loss": one(loss + 100.0), "loss_first_seed": loss}  # (a diverged later seed)
  if kl_mc is not None:
    fig["kl_mc"] = one(kl_mc, ci95)
  return codec.decode(RunFigures, fig, "report.json")


def test_sigma_curve_orders_each_regime_by_sigma_with_the_prop4_envelope():
  plan = _plan()
  figures = {"sum_u1_exact": _fig(0.2, 4.0), "sum_u1_noise1": _fig(0.3, 6.5, 1),
             "sum_u1_fitted": _fig(0.25, 4.5), "sum_u1_vargrad": _fig(0.22, 1.0),
             "sum_u4_noise2": _fig(1.0, 9.0, 1)}  # no exact run at 4 updates: no curve there
  curve = G.sigma_curve(plan, figures, fitted_sigma_g=0.4)
  assert list(curve) == ["sum, 1 update per batch"]
  pts = curve["sum, 1 update per batch"]
  assert [p.run for p in pts] == ["sum_u1_exact", "sum_u1_fitted", "sum_u1_noise1"]
  assert [p.sigma for p in pts] == [0.0, 0.4, 1.0]  # VarGrad has no anchor: not on the curve
  assert pts[2].loss_gap == pytest.approx(2.5)  # first seeds' losses, not the seed means
  assert pts[2].envelope == pytest.approx(1.0 + 2.0 * 1.0 * 2.0)  # sigma^2 + 2 sigma sqrt(4)
  assert plan.runs["sum_u4_noise2"].regime.label == "sum, 4 updates per batch"


def test_the_fitted_anchor_has_no_sigma_on_the_mean_scale():
  plan = _plan("anchor_study_rl_mean")
  assert G.sigma_of(plan, "mean_u4_fitted", 0.4) is None  # the exact log Z is the sum scale's
  assert G.sigma_of(plan, "mean_u4_vargrad", 0.4) is None


def test_the_regime_and_sigma_tables_render_the_grid_section():
  plan = _plan()
  figures = {"sum_u1_exact": _fig(0.2, 4.0, ci95=[0.1, 0.3]), "sum_u1_noise1": _fig(0.3, 6.5, 1)}
  grid = {"regimes": {m: plan.runs[m].regime.label for m in figures}}
  report = {"regime": {"per_method": {"sum_u1_exact": "end state (flat)"}},
            "grid": codec.encode(grid | {"figures": figures,
                                         "sigma_curve": G.sigma_curve(plan, figures, None)})}
  rows = tables.regime_table(tables.read(report))
  assert rows[2] == ("| `sum_u1_exact` | sum, 1 update per batch | 3 | end state (flat) | "
                     "0.200 ± 0.100 [0.100, 0.300] | 0.100 | 100 (3/3) | 50 | 20 |")
  assert rows[3].startswith("| `sum_u1_noise1` | sum, 1 update per batch | 1 | - | 0.300 |")
  sig = tables.sigma_table(tables.read(report))
  assert sig[3] == "| sum, 1 update per batch | `sum_u1_noise1` | 1 | 1 | 0.300 | 2.5 | 5 |"
  # a report of issue 44's instrument: the Monte Carlo KL beside
  figures = {"sum_u1_exact": _fig(0.2, 4.0, ci95=[0.1, 0.3], kl_mc=0.25),
             "sum_u1_noise1": _fig(0.3, 6.5, 1, kl_mc=0.35)}
  report["grid"] = codec.encode(grid | {"figures": figures,
                                        "sigma_curve": G.sigma_curve(plan, figures, None)})
  report["instrument"] = {"primary_metric": "kl_decomposed"}
  rows = tables.regime_table(tables.read(report))
  assert "| KL(pi ‖ pi~), decomposed | KL, Monte Carlo |" in rows[0] and rows[1].count("|") == 11
  assert rows[2].startswith("| `sum_u1_exact` | sum, 1 update per batch | 3 | end state (flat) | "
                            "0.200 ± 0.100 [0.100, 0.300] | 0.250 ± 0.100 [0.100, 0.300] | 0.100 |")
  assert "| KL(pi ‖ pi~), decomposed |" in tables.sigma_table(tables.read(report))[0]


def test_the_tables_header_says_when_runs_have_seeds_of_their_own():
  with open(Path(__file__).parents[1] / "fixtures" / "claims_report.json") as f:
    report = json.load(f)
  assert "Stage 3 seeds [0, 1, 2]," in tables.render(report)  # (a report from before run_seeds)
  report["run_seeds"] = {m: report["stage3_seeds"] for m in report["regime"]["per_method"]}
  assert "Stage 3 seeds [0, 1, 2]," in tables.render(report)
  report["run_seeds"]["grpo"] = [0]
  assert "Stage 3 seeds per run (the seeds column)," in tables.render(report)


def test_a_run_on_another_stage12_data_seed_is_placed_at_its_own_anchors_sigma():
  plan = _plan("claims")
  assert G.sigma_of(plan, "disa", 0.87, {1: 0.48}) == 0.87
  assert G.sigma_of(plan, "disa_data1", 0.87, {1: 0.48}) == 0.48  # not the job's anchor's
  assert G.sigma_of(plan, "disa_data1", 0.87) is None  # its anchor's sigma_g unknown: off the curve
