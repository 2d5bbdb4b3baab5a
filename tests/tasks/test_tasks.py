"""`disa_jax.tasks` (issue 28, scope item 2; issue 46: one registry per concept): tasks keyed by
ability, read from the one reward registry, each with its reward and optional exact target; the sum task's correct set and reward come through it, the math
and code tasks have no exact target, and every workflow that resolves ``reward = "sum_task"`` finds
it without importing the task itself."""
import os
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from disa_jax import rewards, tasks
from disa_jax.data.records import PromptRecord
from disa_jax.data.rows import save_prompts
from disa_jax.eval.exact import MEASURES, ExactMeasures, ExactTargetConfig, ExactTracker
from disa_jax.rollout.types import Completion
from disa_jax.tasks import sum as sum_task
from disa_jax.tasks import Task, get_task
from disa_jax.workflows import stage3

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tok():
  return sum_task.task_tokenizer()


class _Scorer:
  """A `SequenceScorer` stand-in: log-prob -len(response) (recorded calls)."""

  def __init__(self):
    self.calls = 0

  def sequence_logprobs(self, prompts, responses):
    self.calls += 1
    return np.asarray([-float(len(r)) for r in responses], np.float64)

  def token_logprobs(self, prompts, responses):
    self.calls += 1
    return [np.full(len(r), -1.0, np.float32) for r in responses]

  def pack(self, prompts, responses, *, reuse=None):
    return prompts, responses

  def token_logprobs_packed(self, packed):
    return self.token_logprobs(*packed)


def test_the_built_in_tasks_are_registered_by_ability():
  assert {"code", "math", "sum_task"} <= set(tasks.task_names())
  assert tasks.task_names() == rewards.reward_names()  # one registry: a task is a reward's entry
  for name in tasks.task_names():
    task = get_task(name)
    assert task.name == task.ability == name
    assert task.correct_set is rewards.correct_set_of(name)


def test_a_task_registered_with_its_reward_is_found_with_its_correct_set():
  def correct(tokenizer, meta):
    return [[1, 2]]

  rewards.register_reward("one_registry_test_task", lambda rs, ms: np.zeros(len(rs), np.float32),
                          correct_set=correct, overwrite=True)
  task = get_task("one_registry_test_task")
  assert task.correct_set is correct and task.has_exact_target
  np.testing.assert_array_equal(task.reward_fn()(["x"], [{}]).reward, [0.0])


@pytest.mark.parametrize("n", [0, 3, 12])
def test_the_sum_tasks_correct_set_is_every_canonical_answer(tok, n):
  task = get_task("sum_task")
  assert task.has_exact_target
  got = task.correct_set(tok, {"ground_truth": str(n)})
  assert got == sum_task.SumTask(0, n).correct_completions(tok, n)
  assert len(got) == n + 1 and all(c[-1] == tok.eos_token_id for c in got)
  assert [tok.decode(c[:-1]) for c in got] == [f" {a}+{n - a}" for a in range(n + 1)]


def test_the_sum_reward_resolves_through_the_registry(tok):
  fn = get_task("sum_task").reward_fn()
  ids = tok.encode(" 2+3", add_special_tokens=False) + [tok.eos_token_id]
  graded = fn([rewards.Response(" 2+3", tuple(ids)), rewards.Response(" 2+4", tuple(ids[:-1]))],
              [{"ground_truth": 5}, {"ground_truth": 5}])
  np.testing.assert_array_equal(graded.reward, [1.0, 0.0])
  np.testing.assert_array_equal(rewards.get_reward_fn("sum_task")(
      [rewards.Response(" 2+3", tuple(ids))], [{"ground_truth": 5}]).reward, [1.0])


@pytest.mark.parametrize("name", ["math", "code"])
def test_math_and_code_have_no_exact_target(name):
  task = get_task(name)
  assert task.correct_set is None and not task.has_exact_target

  def no_scorer():
    raise AssertionError("a task without an exact target must not load the reference")

  assert task.measures(ExactTargetConfig(), None, [[1, 2]], [{"ground_truth": "1"}], no_scorer,
                       max_tokens=8) is None


def test_an_unknown_ability_names_it_and_the_known_ones():
  with pytest.raises(KeyError, match=r"'poetry'; known tasks: \[") as e:
    get_task("poetry")
  # (other tests of the same worker may have registered rewards of their own: listed too)
  assert all(f"'{name}'" in str(e.value) for name in ("code", "math", "sum_task")), e.value


def test_bad_tasks_are_refused():
  with pytest.raises(ValueError, match="Task.name must be a non-empty str, got ''"):
    Task("")
  with pytest.raises(ValueError, match="correct_set must be callable or None, got int"):
    Task("x", correct_set=3)
  with pytest.raises(ValueError, match="reward 'math' is already registered"):
    rewards.register_reward("math", lambda rs, ms: [0.0] * len(rs))
  with pytest.raises(ValueError, match="reward 'bad_set_task': correct_set must be callable or "
                                       "None, got int"):
    rewards.register_reward("bad_set_task", lambda rs, ms: [0.0] * len(rs), correct_set=3)
  assert "bad_set_task" not in tasks.task_names()
  with pytest.raises(KeyError, match="unknown reward 'poetry'"):
    rewards.correct_set_of("poetry")


def _completion(ids, lp=-1.0):
  return Completion(np.asarray(ids), np.full(len(ids), lp), np.full(len(ids), lp), "stop")


class _Engine:
  """Serves, for every prompt, k samples: the first correct answer, then wrong ones."""

  def __init__(self, tok, n):
    self.right = sum_task.SumTask(0, n).correct_completions(tok, n)[0]
    self.wrong = tok.encode(" 9+9", add_special_tokens=False) + [tok.eos_token_id]

  def generate(self, prompts, params):
    return [[_completion(self.right if i == 0 else self.wrong) for i in range(params.n)]
            for _ in prompts]


def test_the_sum_tasks_measures_are_the_exact_tracker_and_return_exact_measures(tok):
  task, scorer, cfg = get_task("sum_task"), _Scorer(), ExactTargetConfig(beta=2.0, kl_samples=3)
  prompts = [tok.encode(sum_task.SumTask().prompt(n), add_special_tokens=False) for n in (2, 3)]
  tracker = task.measures(cfg, tok, prompts, [{"ground_truth": 2}, {"ground_truth": "3"}],
                          lambda: scorer, max_tokens=8)
  assert isinstance(tracker, ExactTracker) and scorer.calls == 1  # pi_ref scored the 3 + 4 answers
  assert tracker._bounds.tolist() == [0, 3, 7]
  out = tracker.measure(_Engine(tok, 2), _Scorer(), step=1)
  assert isinstance(out, ExactMeasures) and out.samples_per_prompt == 3
  assert list(out.means) == list(MEASURES) and len(out.per_prompt) == 2
  # Stage 3 logs exactly these keys (exact/<key>)
  assert list(out.to_json(per_prompt=False)) == ["samples_per_prompt", *MEASURES]
  # the policy (the same scorer) equals pi_ref on the correct set: no KL there
  assert out["kl_correct"] == pytest.approx(0.0, abs=1e-12)
  assert out.per_prompt[0]["wrong_samples"] == 2


def test_an_empty_correct_set_is_refused(tok):
  task = Task("sum_task", correct_set=lambda tokenizer, meta: [])
  with pytest.raises(ValueError, match=r"the correct set of prompts \[0\] is empty"):
    task.measures(ExactTargetConfig(), tok, [[5]], [{"ground_truth": 1}], _Scorer, max_tokens=8)


@pytest.mark.parametrize("module", ["disa_jax.workflows.stage1", "disa_jax.workflows.stage3",
                                    "disa_jax.workflows.evaluation"])
def test_the_workflows_resolve_the_sum_reward_without_importing_the_task(module):
  """A fresh process that imports only the workflow module finds the 'sum_task' reward (and the
  rewards package alone does not import the tasks)."""
  code = (f"import sys; import disa_jax.rewards as r; "
          f"assert 'sum_task' not in r.reward_names() and 'disa_jax.tasks' not in sys.modules; "
          f"import {module}; r.get_reward_fn('sum_task'); print('ok')")
  out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)},
                       timeout=300)
  assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout + out.stderr


class _ExactSection:
  """`ExactTargetConfig` with stand-in models: `load_model` names the path, `scorer` a `_Scorer`."""

  def __init__(self, **kw):
    self.cfg, self.loaded = ExactTargetConfig(reference_path="ref", **kw), []

  def __getattr__(self, name):
    return getattr(self.cfg, name)

  def load_model(self, path):
    self.loaded.append(path)
    return path

  def scorer(self, model, pad_id):
    scorer = _Scorer()
    scorer.update = lambda policy: None
    return scorer


def _stage3_cfg(tmp_path, ability, ns):
  recs = [PromptRecord(f"p{n}", [{"role": "user", "content": sum_task.SumTask().prompt(n)}],
                       str(n), ability, {"ability": ability}) for n in ns]
  save_prompts(recs, str(tmp_path / "prompts.jsonl"))
  data = types.SimpleNamespace(validation_paths=(str(tmp_path / "prompts.jsonl"),),
                               train_path="", prompts_format="auto", rendering="plain")
  rollout = types.SimpleNamespace(max_prompt_len=64, max_response_len=8)
  return types.SimpleNamespace(data=data, train=types.SimpleNamespace(rollout=rollout),
                               exact_target=_ExactSection(beta=2.0, kl_samples=3))


def test_stage3_logs_the_sum_tasks_exact_measures_through_the_task(tok, tmp_path):
  cfg = _stage3_cfg(tmp_path, "sum_task", (2, 3))
  measures = stage3.exact_measures(cfg, tok, policy="policy", engine=_Engine(tok, 2))
  assert cfg.exact_target.loaded == ["ref"]
  out = measures(4)
  assert list(out) == [f"exact/{k}" for k in ("samples_per_prompt", *MEASURES)]
  assert out["exact/samples_per_prompt"] == 3.0 and all(isinstance(v, float) for v in out.values())


def test_stage3_refuses_exact_measures_of_a_task_without_an_exact_target(tok, tmp_path):
  cfg = _stage3_cfg(tmp_path, "math", (2,))
  with pytest.raises(ValueError, match="the prompts' task 'math' has no exact target"):
    stage3.exact_measures(cfg, tok, policy="policy", engine=_Engine(tok, 2))
  assert cfg.exact_target.loaded == []  # the reference model is not loaded


def test_the_registered_sum_reward_remembers_gradings_per_n_and_response(tok):
  """`sum_task_rewards` grades a (n, response) once and then recalls it: the same rewards as
  `SumTask.reward` for every n, a response correct for one n and wrong for another included."""
  task = sum_task.SumTask(0, 6)
  responses = [c for n in range(7) for c in task.correct_completions(tok, n)]
  responses += [tok.encode(" 2+3", add_special_tokens=False), [tok.eos_token_id]]
  metas = [{"ground_truth": n} for n in range(7)]
  pairs = [(ids, m) for ids in responses for m in metas]
  want = [task.reward(tok, m["ground_truth"], ids) for ids, m in pairs]
  sum_task._task_reward.cache_clear()
  for _ in range(2):  # graded, then recalled
    got = sum_task.sum_task_rewards([ids for ids, _ in pairs], [m for _, m in pairs])
    np.testing.assert_array_equal(got, np.asarray(want, np.float32))
  info = sum_task._task_reward.cache_info()
  assert info.misses == len(pairs) and info.hits == len(pairs)
  assert 0 < sum(want) < len(want)
