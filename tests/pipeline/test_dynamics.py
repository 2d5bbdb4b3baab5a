"""`disa_jax.pipeline.dynamics`: end-state and matched-accuracy verdicts from made-up series whose
answer is known, and the series read back from a Stage 3 metrics file."""
import json

import numpy as np
import pytest

from disa_jax.pipeline import dynamics as D


def _series(steps, kl, p, se=0.05, entropy=None):
  n = len(steps)
  s = {f: np.zeros(n) for f in D.FIELDS}
  s.update(step=np.asarray(steps), kl_mc=np.asarray(kl, float), p_correct=np.asarray(p, float),
           kl_mc_se=np.full(n, se), entropy_correct=np.asarray(entropy if entropy is not None
                                                                else np.linspace(2, 1, n)))
  return s


STEPS = np.arange(0, 3600, 100)  # 36 measurements; the window (last 20%) holds the last 8


def _noise(scale, seed=0):
  return np.random.default_rng(seed).normal(0.0, scale, STEPS.size)


def _run(kl, kl_correct=None, p=0.5, se=0.05):
  s = _series(STEPS, kl, [p] * STEPS.size, se=se)
  s["kl_correct"] = np.asarray(kl_correct if kl_correct is not None else np.full(STEPS.size, 0.2))
  return s


def test_a_rising_kl_at_p_correct_0_95_is_a_transient():
  e = D.end_state(_run(np.exp(STEPS / 1000.0) * 0.1 + _noise(0.01), p=0.95))
  assert e.last["p_correct"] == 0.95 and not e.reached and e.reason == "moving"
  assert e.kl.change > 2 * e.kl.change_se > 0 and e.window_steps == (2800, 3500)


def test_a_steady_decline_within_the_old_two_point_threshold_is_not_flat():
  kl = np.linspace(1.0, 0.4, STEPS.size) + _noise(0.005)  # -0.12 nats over the window
  s = _run(kl, se=0.05)
  # the old rule: |KL(3500) - KL(2800)| < 2 hypot(se, se) = 0.141 called this flat
  assert abs(kl[-1] - kl[-8]) < 2 * np.hypot(0.05, 0.05)
  e = D.end_state(s)
  assert e.reason == "moving" and not e.reached
  assert e.kl.change == pytest.approx(-0.12, abs=0.02) and e.kl.points == 8


def test_a_flat_noisy_curve_is_flat_and_both_curves_must_be():
  # pure noise: flat in most draws (a 2-SE rule on a t with 6 degrees of freedom rejects ~9% of
  # flat curves, so ~17% with two curves: the rule errs towards 'transient')
  flat = [D.end_state(_run(1.0 + _noise(0.05, seed=i), 0.3 + _noise(0.02, seed=1000 + i))).reached
          for i in range(300)]
  assert 0.75 < np.mean(flat) < 0.9
  s = _run(1.0 + _noise(0.05, seed=1), kl_correct=0.3 + _noise(0.02, seed=1001))
  e = D.end_state(s)
  assert e.reached and e.reason == "flat" and e.kl.flat and e.kl_correct.flat
  assert abs(e.kl.change) <= 2 * e.kl.change_se
  # a flat KL whose conditional KL over correct answers still climbs is not at its end state
  s["kl_correct"] = np.linspace(0.1, 1.0, STEPS.size)
  e = D.end_state(s)
  assert e.reason == "moving" and e.kl.flat and not e.kl_correct.flat


def test_a_window_in_the_lr_decay_phase_is_flagged():
  s = _run(1.0 + _noise(0.05, seed=1))
  e = D.end_state(s, lr_decay_step=2975)  # the last 15% of 3,500 steps at lr / 10
  assert not e.reached and e.reason == "flat_under_lr_decay" and e.lr_decay_step == 2975
  assert D.end_state(s, lr_decay_step=3500).reason == "flat"  # a measurement at 3500 follows step 3499


def test_too_few_measurements_are_never_flat_and_bad_input_is_refused():
  for n in (2, 4, 20):  # 20 measurements: 4 in the window
    e = D.end_state(_series(STEPS[:n], [1.0] * n, [0.99] * n))
    assert e.reason == "too_few_measurements" and not e.reached and e.kl is None
  with pytest.raises(ValueError, match="at least 2 measurements, got 1"):
    D.end_state(_series([0], [1], [0.5]))
  with pytest.raises(ValueError, match="distinct steps"):
    D.trend(np.asarray([1, 1, 2]), np.asarray([1.0, 2.0, 3.0]))
  with pytest.raises(ValueError, match="non-finite values"):
    D.trend(np.asarray([1, 2, 3]), np.asarray([1.0, np.nan, 3.0]))


def test_trend_is_the_least_squares_line_with_its_regression_error():
  x = np.asarray([0.0, 1.0, 2.0, 3.0, 4.0])
  y = np.asarray([1.0, 1.4, 2.1, 2.4, 3.1])
  fit = np.polyfit(x, y, 1, cov=True)
  t = D.trend(x, y)
  assert t.change == pytest.approx(fit[0][0] * 4) and t.change_se == pytest.approx(
      np.sqrt(fit[1][0, 0]) * 4)


def test_matched_accuracy_takes_the_first_measurement_at_each_level():
  s = _series([100, 200, 300, 400], [4, 3, 2, 1], [0.4, 0.72, 0.69, 0.95], entropy=[2.0, 1.5, 1.4, 0.9])
  m = D.matched_accuracy(s)
  assert m["0.5"]["step"] == 200 and m["0.7"]["step"] == 200 and m["0.9"]["step"] == 400
  assert m["0.9"]["entropy_correct"] == 0.9 and m["0.5"]["kl"] == 3
  assert D.matched_accuracy(s, levels=(0.99,)) == {"0.99": None}


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
  s = _series([0, 100, 200], [3, 2, 1], [0.5, 0.7, 0.9])
  files = D.plot_dynamics({"disa": s, "grpo": s}, 2.6, tmp_path)
  assert files == ["kl_vs_step.png", "kl_correct_vs_step.png", "entropy_vs_accuracy.png"]
  assert all((tmp_path / f).stat().st_size > 1000 for f in files)


def test_lr_decay_step_follows_the_schedule():
  from disa_jax.rl.train_step import lr_schedule
  sched = lr_schedule(1.0, decay_frac=0.15, decay_factor=0.1, total_updates=3500 * 2)
  first = D.lr_decay_step(3500, 2, 0.15)
  assert first == 2975 and float(sched(first * 2)) == pytest.approx(0.1)
  assert float(sched(first * 2 - 1)) == 1.0 and D.lr_decay_step(3500, 2, 0.0) is None
