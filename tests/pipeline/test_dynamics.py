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


def test_a_flat_kl_curve_is_the_end_state_and_a_falling_one_is_a_transient():
  steps = np.arange(0, 1100, 100)
  flat = _series(steps, [5, 4, 3, 2, 1.5, 1.2, 1.1, 1.05, 1.02, 1.01, 1.0], [0.5] * 11)
  e = D.end_state(flat)
  # the window is the last 20% of the steps (800..1000): KL moves 0.02 < 2 * hypot(0.05, 0.05)
  assert e["reached"] and e["reason"] == "flat" and e["window_steps"] == [800, 1000]
  assert e["kl_change"] == pytest.approx(-0.02)
  falling = _series(steps, np.linspace(5, 1, 11), [0.5] * 11)
  e = D.end_state(falling)
  assert not e["reached"] and e["reason"] == "transient" and e["kl_change"] == pytest.approx(-0.8)
  # the same fall with noisy estimates (se 1.0) is not distinguishable from flat
  assert D.end_state(_series(steps, np.linspace(5, 1, 11), [0.5] * 11, se=1.0))["reason"] == "flat"
  # ... but two or four measurements are too few to call any curve flat
  for n in (2, 4):
    assert D.end_state(_series(steps[:n], [1.0] * n, [0.5] * n))["reason"] == "transient"


def test_p_correct_at_or_above_0_9_is_the_end_state_whatever_the_kl_does():
  e = D.end_state(_series([0, 50, 100], [9, 5, 1], [0.3, 0.8, 0.9]))
  assert e["reached"] and e["reason"] == "p_correct" and e["p_correct"] == 0.9
  assert not D.end_state(_series([0, 50, 100], [9, 5, 1], [0.3, 0.8, 0.899]))["reached"]
  with pytest.raises(ValueError, match="at least 2 measurements, got 1"):
    D.end_state(_series([0], [1], [0.5]))


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
