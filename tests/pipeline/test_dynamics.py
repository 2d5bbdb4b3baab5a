"""`disa_jax.pipeline.dynamics`: the end-state rule by equivalence, its error rates over many noise
draws at the claims preset's cadence (vectorised, fixed seed), matched accuracy by interpolation,
and the series read back from a Stage 3 metrics file."""
import json

import numpy as np
import pytest

from configs import main as main_config
from disa_jax.pipeline import dynamics as D

CFG = D.EndStateConfig()
DRAWS = 4000
# The claims preset's measured steps (track.every = SMALL_TRACK over CLAIMS_STEPS) and its window.
CLAIMS_STEPS = np.arange(main_config.SMALL_TRACK, main_config.CLAIMS_STEPS + 1,
                         main_config.SMALL_TRACK)
WIN = CLAIMS_STEPS[D.window_mask(CLAIMS_STEPS, CFG)]


def _series(steps, kl, p=None, se=0.01, kl_correct=None, entropy=None):
  n = len(steps)
  s = {f: np.zeros(n) for f in D.FIELDS}
  s.update(step=np.asarray(steps), kl_decomposed=np.asarray(kl, float), kl_mc=np.asarray(kl, float),
           kl_decomposed_se=np.full(n, se), kl_mc_se=np.full(n, 5 * se),
           p_correct=np.asarray(p if p is not None else np.full(n, 0.99), float),
           kl_correct=np.asarray(kl_correct if kl_correct is not None else np.full(n, 0.2), float),
           entropy_correct=np.asarray(entropy if entropy is not None else np.linspace(2, 1, n)))
  return s


def _rates(truth, noise, se=None, steps=WIN, seed=0):
  """Over DRAWS noise draws of ``truth`` ``[n]`` + N(0, noise^2) (the fit told the Monte Carlo
  errors ``se``, None: 0): the share of each verdict (`wls_change` + `equivalence`, the rule's
  own code, vectorised)."""
  rng = np.random.default_rng(seed)
  y = np.asarray(truth, float)[None] + rng.normal(0.0, 1.0, (DRAWS, steps.size)) * noise
  fit = D.wls_change(steps, y, None if se is None else np.full_like(y, se))
  v = D.equivalence(fit["change"], fit["change_se"], fit["df"], fit["value"] - fit["change"] / 2,
                    CFG)["verdict"]
  return {k: float(np.mean(v == k)) for k in ("flat", "moving", "unresolved")}


def test_the_claims_preset_puts_enough_measurements_in_the_window():
  assert WIN.size >= CFG.min_points and (WIN[0], WIN[-1]) == (608, 800)  # 13 measurements


def test_without_monte_carlo_errors_the_line_is_ordinary_least_squares():
  x = np.asarray([0.0, 1.0, 2.0, 3.0, 4.0])
  y = np.asarray([1.0, 1.4, 2.1, 2.4, 3.1])
  (slope, _), cov = np.polyfit(x, y, 1, cov=True)
  fit = D.wls_change(x, y)
  assert fit["change"] == pytest.approx(slope * 4) and fit["df"] == 3
  assert fit["change_se"] == pytest.approx(np.sqrt(cov[0, 0]) * 4, rel=1e-9)
  assert fit["value"] == pytest.approx(np.polyval(np.polyfit(x, y, 1), 4.0))


def test_monte_carlo_errors_weight_the_line_and_excess_scatter_is_added():
  x = np.arange(10.0)
  se = np.linspace(0.01, 0.1, 10)
  y = 0.5 + 0.01 * x + np.asarray([1, -1] * 5) * se * 0.5  # residuals well inside the errors
  fit = D.wls_change(x, y, se)
  w = 1 / se ** 2  # the weighted normal equations with the known variances
  cov = np.linalg.inv(np.stack([x / 9, np.ones(10)], 1).T @ (w[:, None] * np.stack([x / 9, np.ones(10)], 1)))
  assert fit["tau"] == 0.0 and fit["change_se"] == pytest.approx(np.sqrt(cov[0, 0]), rel=1e-9)
  wide = y + np.asarray([1, -1] * 5) * 0.5  # scatter far beyond the errors: tau takes it up
  big = D.wls_change(x, wide, se)
  assert big["tau"] > 0.3 and big["change_se"] > 10 * fit["change_se"]
  resid = wide - np.polyval(np.polyfit(x, wide, 1), x)  # Paule-Mandel: weighted residuals = dof
  assert np.sum(resid ** 2 / (se ** 2 + big["tau"] ** 2)) == pytest.approx(8, rel=0.05)


def test_a_flat_curve_at_the_presets_noise_is_shown_flat_in_most_draws():
  # primary KL 0.3 (delta 0.03): Monte Carlo error 0.25 delta per point (32 samples per prompt) and
  # excess scatter 0.15 delta; conditional KL 0.08 (delta 0.02) with scatter 0.3 delta, exact
  kl = _rates(np.full(WIN.size, 0.3), np.hypot(0.0075, 0.0045), se=0.0075)
  kl_c = _rates(np.full(WIN.size, 0.08), 0.006, seed=1)
  assert kl["flat"] >= 0.8 and kl_c["flat"] >= 0.8
  assert kl["moving"] <= 0.05 and kl_c["moving"] <= 0.05  # pure noise is not called moving


@pytest.mark.parametrize("noise_in_deltas", [0.3, 1.0, 3.0])
def test_a_curve_moving_by_two_margins_is_almost_never_called_flat(noise_in_deltas):
  delta = float(CFG.delta(0.3))  # at a mean level of 0.3 nats
  truth = np.linspace(0.3 + delta, 0.3 - delta, WIN.size)
  for se in (None, noise_in_deltas * delta):  # scatter unexplained / explained by the MC errors
    assert _rates(truth, noise_in_deltas * delta, se=se)["flat"] <= 0.10


@pytest.mark.parametrize("start,end,noise,se", [
    (0.8, 0.5, 0.12, 0.12),  # a KL still falling, the Monte Carlo KL's own error (old rule: 42%)
    (0.30, 0.20, 0.03, None),  # a conditional KL still falling (old rule: 22%)
    (0.7, 0.5, 0.12, 0.12),  # a 0.2-nat drop under per-point noise 0.12 (old rule: 65%)
])
def test_the_issues_moving_curves_are_not_end_states(start, end, noise, se):
  assert _rates(np.linspace(start, end, WIN.size), noise, se=se)["flat"] <= 0.10


def test_pure_noise_on_the_monte_carlo_kl_is_undecided_not_moving():
  r = _rates(np.full(WIN.size, 0.5), 0.12, se=0.12)  # the issue's 25% "moving" under the old rule
  assert r["moving"] <= 0.05 and r["unresolved"] >= 0.9


def test_both_curves_must_be_flat_and_the_lr_decay_is_flagged():
  steps = np.arange(16, 801, 16)
  rng = np.random.default_rng(3)
  flat = 0.3 + rng.normal(0, 0.002, steps.size)
  e = D.end_state(_series(steps, flat, se=0.002, kl_correct=0.08 + rng.normal(0, 0.001, steps.size)))
  assert e.reached and e.reason == "flat" and e.points == 13 and e.window_steps == (608, 800)
  assert e.kl.flat and e.kl_correct.flat and abs(e.kl.high) < e.kl.delta == pytest.approx(0.09, 0.02)
  assert e.label.startswith("end state")
  rising = np.clip((steps - 608) / 192, 0, 1) * 0.45 + 0.05  # 0.05 -> 0.5 across the window
  climbing = D.end_state(_series(steps, flat, se=0.002, kl_correct=rising))
  assert climbing.reason == "moving" and climbing.kl.flat and not climbing.kl_correct.flat
  decayed = D.end_state(_series(steps, flat, se=0.002, kl_correct=np.full(steps.size, 0.08)),
                        lr_decay_step=680)
  assert not decayed.reached and decayed.reason == "flat_under_lr_decay"
  assert "lr decay" in decayed.label


def test_too_few_measurements_are_undecided_and_say_how_many():
  steps = np.arange(32, 801, 32)  # the old cadence: 7 measurements in the window
  e = D.end_state(_series(steps, np.full(steps.size, 0.3)))
  assert e.reason == "too_few_measurements" and not e.reached and e.kl is None
  assert e.label == "undecided (7 measurements in the window, 10 needed)"
  with pytest.raises(ValueError, match="at least 2 measurements, got 1"):
    D.end_state(_series([0], [1.0]))
  with pytest.raises(ValueError, match="distinct steps"):
    D.wls_change(np.asarray([1, 1, 2]), np.asarray([1.0, 2.0, 3.0]))
  with pytest.raises(ValueError, match="non-finite values"):
    D.wls_change(np.asarray([1, 2, 3]), np.asarray([1.0, np.nan, 3.0]))
  with pytest.raises(ValueError, match=r"end_state.min_points must be an int >= 3"):
    D.EndStateConfig(min_points=2)
  with pytest.raises(ValueError, match=r"end_state.window must be in \(0, 1\], got 0"):
    D.EndStateConfig(window=0)


def test_a_method_pools_its_seeds_and_their_spread_counts():
  def trend(change, se=0.005, value=0.3):
    return D.Trend.decide(change, se, 11, value, CFG, tau=0.0, points=13)
  pooled = D.pool_trends([trend(c) for c in (0.004, -0.003, 0.006, 0.0, -0.002)])
  assert pooled.flat and pooled.change == pytest.approx(0.001)
  assert pooled.change_se == pytest.approx(np.sqrt(5 * 0.005 ** 2) / 5)  # their own errors
  apart = D.pool_trends([trend(c) for c in (0.1, -0.1, 0.1, -0.1)])  # mean 0, seeds moving
  assert apart.change == 0.0 and apart.df == 3 and not apart.flat
  assert apart.change_se == pytest.approx(np.std([0.1, -0.1] * 2, ddof=1) / 2)


def test_a_stuck_curves_tiny_error_pools_without_a_nan():
  """A diverged run stuck at one value has a change error ~1e-150 (the staleness study's
  k2_disa_rep4 on its own, a cell of one seed per anchor replica): its square underflows and the
  Welch-Satterthwaite formula read 0 / 0; the pooled trend keeps the seed's degrees of freedom."""
  stuck = D.Trend.decide(0.0, 1.04e-150, 8.0, 80.0, CFG, tau=0.0, points=13)
  pooled = D.pool_trends([stuck])
  assert pooled.df == 8.0 and pooled.change == 0.0
  two = D.pool_trends([stuck, D.Trend.decide(0.0, 2.08e-150, 4.0, 80.0, CFG, tau=0.0, points=13)])
  assert two.df == pytest.approx((1 + 4) ** 2 / (1 / 8 + 16 / 4))  # the formula on se^2 / max


def test_method_end_state_is_undecided_when_a_seed_has_too_few_measurements():
  steps = np.arange(16, 801, 16)
  ok = D.end_state(_series(steps, np.full(steps.size, 0.3) + 1e-4 * np.sin(steps), se=0.001,
                           kl_correct=0.08 + 1e-4 * np.cos(steps)))
  short = D.end_state(_series(steps[::4], np.full(steps[::4].size, 0.3)))
  both = D.method_end_state([ok, short])
  assert ok.reached and both.reason == "too_few_measurements" and both.seeds == 2
  assert D.method_end_state([ok, ok]).reached


def test_matched_accuracy_interpolates_to_the_level_and_flags_a_level_already_past():
  s = _series([100, 200, 300, 400], [4.0, 3.0, 2.0, 1.0], p=[0.4, 0.72, 0.69, 0.95],
              entropy=[2.0, 1.5, 1.4, 0.9])
  m = D.matched_accuracy(s)
  assert m["0.5"].step == pytest.approx(100 + 100 * 0.1 / 0.32)
  assert m["0.5"].entropy_correct == pytest.approx(2.0 - 0.5 * 0.1 / 0.32)
  assert m["0.5"].p_correct == 0.5 and not m["0.5"].already_past
  assert m["0.9"].kl == pytest.approx(2.0 - 1.0 * 0.21 / 0.26)  # between 300 and 400
  assert D.matched_accuracy(s, levels=(0.99,)) == {"0.99": None}
  past = D.matched_accuracy(_series([100, 200], [2.0, 1.0], p=[0.93, 0.97]), levels=(0.9,))["0.9"]
  assert past.already_past and past.step == 100 and past.p_correct == 0.93


def test_mean_std_skips_missing_values():
  assert D.mean_std([1.0, None, 3.0, float("nan")]) == (2.0, pytest.approx(np.sqrt(2)))
  assert D.mean_std([4.0]) == (4.0, 0.0)
  assert all(np.isnan(D.mean_std([None])))


def test_exact_series_reads_only_the_measured_steps(tmp_path):
  rows = [{"step": 1, "loss": 1.0}]
  for step in (2, 4):
    rows.append({"step": step, "loss": 0.5, **{f"exact/{f}": step * 1.0 for f in D.FIELDS}})
  path = tmp_path / "metrics.jsonl"
  path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
  s = D.exact_series(path)
  np.testing.assert_array_equal(s["step"], [2, 4])
  np.testing.assert_array_equal(s["kl_decomposed_se"], [2.0, 4.0])


def test_plots_are_written(tmp_path):
  s = _series([0, 100, 200], [3, 2, 1], p=[0.5, 0.7, 0.9])
  files = D.plot_dynamics({"disa": s, "grpo": s}, 2.6, tmp_path)
  assert files == ["kl_vs_step.png", "kl_correct_vs_step.png", "entropy_vs_accuracy.png"]
  assert all((tmp_path / f).stat().st_size > 1000 for f in files)


def test_lr_decay_step_follows_the_schedule():
  from disa_jax.optim import lr_schedule
  sched = lr_schedule(1.0, decay_frac=0.15, decay_factor=0.1, total_updates=3500 * 2)
  first = D.lr_decay_step(3500, 2, 0.15)
  assert first == 2975 and float(sched(first * 2)) == pytest.approx(0.1)
  assert float(sched(first * 2 - 1)) == 1.0 and D.lr_decay_step(3500, 2, 0.0) is None


@pytest.mark.parametrize("total,every,early", [(480, 8, 48), (400, 8, 40), (1000, 20, 100),
                                               (333, 7, 50), (96, 8, 16)])
def test_a_sparse_start_leaves_only_dense_measurements_in_the_window(total, every, early):
  """`TrackConfig.cadence`: with ``every_before_window`` the measured steps (`ValidationConfig.due`)
  put the sparse ones before the end-state window, and the window holds exactly the measurements
  the dense cadence would put there."""
  from disa_jax.pipeline.job_config import TrackConfig
  from disa_jax.rl.config import ValidationConfig
  track = TrackConfig(every=every, every_before_window=early)
  cadence = track.cadence(total, CFG)
  steps = np.asarray([s for s in range(1, total + 1) if ValidationConfig(**cadence).due(s)])
  inside = steps[D.window_mask(steps, CFG)]
  assert steps[0] == early and cadence["dense_from"] > early
  assert np.all(np.diff(inside) == every) and inside[-1] == total - total % every
  assert np.all(steps[steps < cadence["dense_from"]] % early == 0)
  assert steps.size < len(range(every, total + 1, every))  # fewer measurements in all
  # the window starts at or after the first dense measurement
  assert inside[0] >= cadence["dense_from"] and inside[0] - every < CFG.window_start(early,
                                                                                      inside[-1])


def test_without_a_sparse_start_the_cadence_is_every_and_bad_settings_are_refused():
  from disa_jax.pipeline.job_config import TrackConfig
  from disa_jax.rl.config import ValidationConfig
  assert TrackConfig(every=8).cadence(480, CFG) == {"every": 8}
  # a sparse cadence that leaves no sparse step before the window (its first step, 476, is past
  # the last dense step before it, 472): dense throughout
  assert TrackConfig(every=8, every_before_window=476).cadence(480, CFG) == {"every": 8}
  with pytest.raises(ValueError, match=r"track.every_before_window must be 0 \(off\), or > 0 "
                                       r"with track.every > 0, got 8 \(track.every=0\)"):
    TrackConfig(every=0, every_before_window=8)
  with pytest.raises(ValueError,
                     match=r"validation.early_every needs every > 0 and dense_from > 0"):
    ValidationConfig(every=8, early_every=48)
  assert [s for s in range(1, 13) if ValidationConfig(every=2).due(s)] == [2, 4, 6, 8, 10, 12]
  assert [s for s in range(1, 13) if ValidationConfig(every=0).due(s)] == []


def test_a_dense_start_measures_step_0_and_every_start_every_steps_over_the_first_tenth():
  """`TrackConfig.start_every` (issue 62): the testbed's cadence, 600 steps tracked every 40."""
  from disa_jax.pipeline.job_config import TrackConfig
  from disa_jax.rl.config import ValidationConfig
  cadence = TrackConfig(every=40, start_every=10).cadence(600, CFG)
  vc = ValidationConfig(**cadence)
  steps = [s for s in range(1, 601) if vc.due(s)]
  assert vc.at_start and steps[:7] == [10, 20, 30, 40, 50, 60, 80] and steps[-1] == 600
  assert len(steps) + 1 == 21  # step 0 and 20 more: 15 before, +6
  window = np.asarray([0] + steps)
  assert window[D.window_mask(window, CFG)].tolist() == [480, 520, 560, 600]  # as before
  with pytest.raises(ValueError, match=r"track.start_share must be in \(0, 1\], got 0"):
    TrackConfig(every=40, start_every=10, start_share=0)


def test_a_dense_start_a_sparse_middle_and_a_dense_window_in_one_schedule():
  """`TrackConfig.cadence` with ``start_every`` and ``every_before_window`` (issue 62, the default
  job): step 0 and every 10 steps to step 88, then every 32, then every 16 in the end-state
  window, which holds exactly the dense measurements."""
  from disa_jax.pipeline.job_config import TrackConfig
  from disa_jax.rl.config import ValidationConfig
  cadence = TrackConfig(every=16, every_before_window=32, start_every=10).cadence(880, CFG)
  vc = ValidationConfig(**cadence)
  steps = np.asarray([0] + [s for s in range(1, 881) if vc.due(s)])
  assert vc.at_start and steps[:10].tolist() == [0, 10, 20, 30, 40, 50, 60, 70, 80, 96]
  assert np.all(steps[(steps > 88) & (steps < cadence["dense_from"])] % 32 == 0)
  inside = steps[D.window_mask(steps, CFG)]
  assert inside[0] >= cadence["dense_from"] and np.all(np.diff(inside) == 16)
  assert inside[-1] == 880 and inside.size >= CFG.min_points
  with pytest.raises(ValueError, match=r"validation.start_every / start_until"):
    ValidationConfig(every=16, start_every=10)
