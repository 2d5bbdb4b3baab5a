"""The sum task's warm-up specs: the per-prompt share of correct answers (issue 45)."""
import numpy as np
import pytest

from disa_jax import config as config_lib
from disa_jax.pipeline.sum_models import (NEAR_MISS, TinyLMSpec, WarmupSpec, _answer_text,
                                          train_sum_model)
from disa_jax.tasks.sum import SumTask, make_tokenizer

TOK = make_tokenizer()


def _draw(rng, task, n, spec, **kw) -> tuple[str, bool]:
  """A made-up answer and whether the task's own verifier takes it."""
  text = _answer_text(rng, task, n, spec, **kw)
  ids = TOK.encode(text, add_special_tokens=False) + [TOK.eos_token_id]
  return text, task.reward(TOK, n, ids) == 1.0


def _pair(text: str) -> tuple[int, int]:
  a, b = text.strip().split("+")
  return int(a), int(b)


def test_correct_share_falls_geometrically_from_first_to_last_n():
  spec = WarmupSpec(correct_frac=0.9, correct_frac_last=0.01)
  assert spec.correct_frac_at(0, 0, 159) == pytest.approx(0.9)
  assert spec.correct_frac_at(159, 0, 159) == pytest.approx(0.01)
  mid = spec.correct_frac_at(53, 0, 159)  # a third of the way: 0.9^(2/3) 0.01^(1/3)
  assert mid == pytest.approx(0.9 ** (2 / 3) * 0.01 ** (1 / 3))
  assert WarmupSpec(correct_frac=0.6).correct_frac_at(100, 0, 159) == 0.6  # off: constant
  assert "correct_frac_last" not in config_lib.to_dict(WarmupSpec(correct_frac=0.6))  # old markers match
  assert config_lib.to_dict(WarmupSpec(correct_frac=0.6, correct_frac_last=0.1))["correct_frac_last"] == 0.1


def test_drawn_answers_follow_the_share_of_their_prompt():
  task = SumTask(n_min=0, n_max=40)
  spec = WarmupSpec(correct_frac=0.9, correct_frac_last=0.05)
  rng = np.random.default_rng(0)
  for n in (0, 40):
    hits = np.mean([_draw(rng, task, n, spec)[1] for _ in range(4000)])
    assert hits == pytest.approx(spec.correct_frac_at(n, 0, 40), abs=0.02), n


@pytest.mark.parametrize("last", [1.5, 0.0])
def test_a_bad_last_share_is_refused(last):
  with pytest.raises(ValueError, match="correct_frac_last"):
    WarmupSpec(correct_frac=0.9, correct_frac_last=last)


def test_pretraining_draws_only_correct_answers_and_is_recorded_only_where_set():
  task = SumTask(n_min=0, n_max=40)
  spec = WarmupSpec(correct_frac=0.9, correct_frac_last=0.01, pretrain_steps=10)
  rng = np.random.default_rng(0)
  assert all(_draw(rng, task, 40, spec, correct_only=True)[1] for _ in range(500))
  assert np.mean([_draw(rng, task, 40, spec)[1] for _ in range(500)]) < 0.05
  assert "pretrain_steps" not in config_lib.to_dict(WarmupSpec(correct_frac=0.6))  # old markers match
  assert config_lib.to_dict(spec)["pretrain_steps"] == 10
  with pytest.raises(ValueError, match="pretrain_steps must be >= 0, got -1"):
    WarmupSpec(correct_frac=0.9, pretrain_steps=-1)


def test_near_misses_are_wrong_by_at_most_near_miss_and_never_negative():
  task = SumTask(n_min=0, n_max=40)
  spec = WarmupSpec(correct_frac=0.5, wrong_answers="near")
  rng = np.random.default_rng(1)
  for n in (0, 1, 40):
    draws = [_draw(rng, task, n, spec) for _ in range(2000)]
    pairs = [_pair(t) for t, _ in draws]
    assert all((a + b == n) == ok for (a, b), (_, ok) in zip(pairs, draws))
    slips = np.array([a + b - n for a, b in pairs])
    assert all(a >= 0 and b >= 0 and a <= n for a, b in pairs), n
    assert np.abs(slips).max() <= NEAR_MISS and np.mean(slips == 0) == pytest.approx(0.5, abs=0.04)
    if n == 0:  # b = 0 + d >= 0: only upward slips
      assert set(slips[slips != 0]) == set(range(1, NEAR_MISS + 1))
    if n == 40:
      assert set(slips[slips != 0]) == set(range(-NEAR_MISS, NEAR_MISS + 1)) - {0}
  assert config_lib.to_dict(WarmupSpec(correct_frac=0.5, wrong_answers="near"))["wrong_answers"] == "near"
  assert "wrong_answers" not in config_lib.to_dict(WarmupSpec(correct_frac=0.5))
  with pytest.raises(ValueError, match="wrong_answers must be one of .* got 'far'"):
    WarmupSpec(correct_frac=0.5, wrong_answers="far")


def test_the_share_can_follow_the_last_digit_of_n():
  spec = WarmupSpec(correct_frac=0.9, correct_frac_last=0.01, correct_frac_of="last_digit")
  for n in (0, 10, 150):
    assert spec.correct_frac_at(n, 0, 159) == pytest.approx(0.9)
  for n in (9, 59, 159):
    assert spec.correct_frac_at(n, 0, 159) == pytest.approx(0.01)
  assert spec.correct_frac_at(4, 0, 159) == pytest.approx(0.9 ** (5 / 9) * 0.01 ** (4 / 9))
  assert config_lib.to_dict(spec)["correct_frac_of"] == "last_digit"
  assert "correct_frac_of" not in config_lib.to_dict(WarmupSpec(correct_frac=0.9))
  with pytest.raises(ValueError, match="correct_frac_of must be one of .* got 'first_digit'"):
    WarmupSpec(correct_frac=0.9, correct_frac_of="first_digit")


def test_format_errors_are_the_right_sum_without_its_space_and_the_verifier_rejects_them():
  task = SumTask(n_min=0, n_max=159)
  spec = WarmupSpec(correct_frac=0.9, correct_frac_last=0.01, wrong_answers="format",
                    correct_frac_of="last_digit")
  rng = np.random.default_rng(2)
  for n in (0, 9, 159):
    draws = [_draw(rng, task, n, spec) for _ in range(3000)]
    assert all(sum(_pair(t)) == n for t, _ in draws)  # every answer adds up ...
    assert all(ok == t.startswith(" ") for t, ok in draws)  # ... but only the spaced ones count
    share = spec.correct_frac_at(n, 0, 159)
    assert np.mean([ok for _, ok in draws]) == pytest.approx(share, abs=0.02), n


def test_the_warm_up_runs_its_pretraining_steps_first_under_one_schedule():
  arch = TinyLMSpec(hidden_size=16, intermediate_size=32, num_heads=2, num_kv_heads=1, head_dim=8)
  spec = WarmupSpec(correct_frac=0.5, steps=2, pretrain_steps=3, batch_size=4)
  _, summary = train_sum_model(SumTask(n_min=0, n_max=9), arch, spec, progress=False)
  assert summary["steps"] == 5 and len(summary["losses"]) == 5
