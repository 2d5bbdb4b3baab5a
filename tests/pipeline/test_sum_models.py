"""The sum task's warm-up specs: the per-prompt share of correct answers (issue 45)."""
import numpy as np
import pytest

from disa_jax.pipeline.sum_models import WarmupSpec, _answers
from disa_jax.tasks.sum import SumTask


def test_correct_share_falls_geometrically_from_first_to_last_n():
  spec = WarmupSpec(correct_frac=0.9, correct_frac_last=0.01)
  assert spec.correct_frac_at(0, 0, 159) == pytest.approx(0.9)
  assert spec.correct_frac_at(159, 0, 159) == pytest.approx(0.01)
  mid = spec.correct_frac_at(53, 0, 159)  # a third of the way: 0.9^(2/3) 0.01^(1/3)
  assert mid == pytest.approx(0.9 ** (2 / 3) * 0.01 ** (1 / 3))
  assert WarmupSpec(correct_frac=0.6).correct_frac_at(100, 0, 159) == 0.6  # off: constant
  assert "correct_frac_last" not in WarmupSpec(correct_frac=0.6).record()  # old markers match
  assert WarmupSpec(correct_frac=0.6, correct_frac_last=0.1).record()["correct_frac_last"] == 0.1


def test_drawn_answers_follow_the_share_of_their_prompt():
  task = SumTask(n_min=0, n_max=40)
  spec = WarmupSpec(correct_frac=0.9, correct_frac_last=0.05)
  rng = np.random.default_rng(0)
  for n in (0, 40):
    hits = np.mean([sum(_answers(rng, task, n, spec)) == n for _ in range(4000)])
    assert hits == pytest.approx(spec.correct_frac_at(n, 0, 40), abs=0.02), n


@pytest.mark.parametrize("last", [1.5, 0.0])
def test_a_bad_last_share_is_refused(last):
  with pytest.raises(ValueError, match="correct_frac_last"):
    WarmupSpec(correct_frac=0.9, correct_frac_last=last)
