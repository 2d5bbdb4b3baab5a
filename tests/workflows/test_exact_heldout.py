"""Stage 3's exact measures of the held-out prompts (`ExactTargetConfig.heldout_path`, issue 45):
logged under 'exact_heldout/' beside the run's own 'exact/', each equal to a tracker of that prompt
set alone, and read back by `ExactSeries.from_rows(prefix=...)`."""
import dataclasses

import pytest
from flax import nnx

from disa_jax import models, tasks
from disa_jax.data.prompting import encode_prompt
from disa_jax.data.rows import save_prompts
from disa_jax.eval.exact import ExactTargetConfig
from disa_jax.pipeline import sum_models
from disa_jax.pipeline.sum_job import prompt_records
from disa_jax.rl.config import TrainConfig
from disa_jax.rl.objectives import Grpo
from disa_jax.rollout.jax_sampler import JaxSampler
from disa_jax.tasks.prompts import load_prompts
from disa_jax.tasks.sum import SumTask, task_tokenizer
from disa_jax.workflows import stage3
from disa_jax.workflows.stage3 import DataConfig, ExactSeries, Stage3Config

SPEC = sum_models.TinyLMSpec(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                             num_kv_heads=1, head_dim=16)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  root = tmp_path_factory.mktemp("exact_heldout")
  tok = task_tokenizer()
  ref = models.Transformer(sum_models.model_config(tok, SPEC), rngs=nnx.Rngs(0))
  policy = models.Transformer(sum_models.model_config(tok, SPEC), rngs=nnx.Rngs(1))
  ref_path = sum_models.save_model(ref, root / "ref")
  recs = prompt_records(SumTask(0, 5))
  save_prompts(recs[:4], str(root / "train.jsonl"))
  save_prompts(recs[4:], str(root / "held.jsonl"))
  et = ExactTargetConfig(reference_path=ref_path, kl_samples=4, seed=3)
  return root, tok, policy, et


def _cfg(root, et, heldout: bool) -> Stage3Config:
  base = Stage3Config.__dataclass_fields__["model"].default
  train = TrainConfig()
  train = dataclasses.replace(train, objective=Grpo(), rollout=dataclasses.replace(
      train.rollout, max_prompt_len=32, max_response_len=8))
  return Stage3Config(
      workdir=str(root / "run"), model=dataclasses.replace(base, policy_path=et.reference_path),
      data=DataConfig(train_path=str(root / "train.jsonl"), reward="sum_task", rendering="plain"),
      train=train,
      exact_target=dataclasses.replace(et, heldout_path=str(root / "held.jsonl") if heldout else ""))


@pytest.mark.slow  # (~10-20 s on 2 cores: three trackers of a tiny model)
def test_the_held_out_prompts_are_measured_beside_the_run_prompts(setup):
  root, tok, policy, et = setup
  engine = JaxSampler(policy)
  both = stage3.exact_measures(_cfg(root, et, True), tok, policy, engine)(step=7)
  alone = stage3.exact_measures(_cfg(root, et, False), tok, policy, engine)(step=7)
  train = {k: v for k, v in both.items() if k.startswith("exact/")}
  held = {k[len("exact_heldout/"):]: v for k, v in both.items() if k.startswith("exact_heldout/")}
  assert train == alone and set(held) == {k[len("exact/"):] for k in alone}
  # the held-out measures are those of a tracker of the held-out prompts alone
  records = load_prompts(str(root / "held.jsonl"))
  tracker = tasks.get_task(records[0].ability).measures(
      et, tok, [encode_prompt(tok, r, "plain", max_len=32) for r in records],
      [r.reward_meta() for r in records],
      lambda: et.scorer(et.load_model(et.reference_path), tok.pad_token_id), max_tokens=8)
  want = tracker.measure(engine, et.scorer(policy, tok.pad_token_id), step=7).to_json(
      per_prompt=False)
  assert held == pytest.approx({k: float(v) for k, v in want.items()})
  assert held["p_correct"] != train["exact/p_correct"]  # other prompts, other values
  rows = [{"step": 7, **both}, {"step": 8, "loss": 1.0}]
  series = ExactSeries.from_rows(rows, "m", "exact_heldout")
  assert series["step"].tolist() == [7] and series["p_correct"][0] == held["p_correct"]
  assert ExactSeries.from_rows(rows, "m")["p_correct"][0] == train["exact/p_correct"]


def test_a_held_out_path_without_the_measures_is_refused():
  with pytest.raises(ValueError, match=r"exact_target.heldout_path='h.jsonl' needs "
                                       "exact_target.reference_path"):
    ExactTargetConfig(heldout_path="h.jsonl")
