"""benchmarks/bench_wrong_term.py on a tiny sum-task policy: each setting of the wrong-answer term
measures the same policy on fresh samples, and the summary's ratios are against the first."""
import argparse
import json

from flax import nnx

from disa_jax import models
from disa_jax.data.rows import save_prompts
from disa_jax.pipeline import sum_models
from disa_jax.pipeline.sum_job import prompt_records
from disa_jax.tasks.sum import SumTask, task_tokenizer
from tests.benchmarks.scripts import load

bw = load("bench_wrong_term")
SPEC = sum_models.TinyLMSpec(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                             num_kv_heads=1, head_dim=16)


def test_each_setting_measures_the_policy_on_fresh_samples(tmp_path):
  tok = task_tokenizer()
  ref = sum_models.save_model(models.Transformer(sum_models.model_config(tok, SPEC),
                                                 rngs=nnx.Rngs(0)), tmp_path / "ref")
  run = tmp_path / "stage3" / "m"
  sum_models.save_model(models.Transformer(sum_models.model_config(tok, SPEC), rngs=nnx.Rngs(1)),
                        run / "final")
  save_prompts(prompt_records(SumTask(0, 2)), str(tmp_path / "p.jsonl"))
  (run / "config.json").write_text(json.dumps({
      "exact_target": {"reference_path": ref, "beta": 2.0},
      "data": {"train_path": str(tmp_path / "p.jsonl"), "rendering": "plain"},
      "train": {"rollout": {"max_prompt_len": 32, "max_response_len": 8}}}))
  args = argparse.Namespace(reps=3, wrong_samples=[0, 4], share_prompts=[0, 1],
                            wrong_decode=["full", "cached"], scorer_rows=[64, 2], kl_samples=4,
                            seed=7)
  got = bw._run(tmp_path, "m", args)
  assert set(got) == {f"w{k}{s}{d}{r}" for k in (0, 4) for s in ("", "_s1")
                      for d in ("", "_cached") for r in ("", "_r2")}
  assert all(len(g[x]) == 3 for g in got.values() for x in g)
  assert len(set(got["w4"]["kl"])) == 3  # fresh samples at every rep
  out = bw._summary(got, "w0")
  assert out["w0"]["sd_ratio"] == 1.0 and out["w0"]["time_ratio"] == 1.0
  assert out["w4"]["sd_ratio"] == out["w4"]["sd"] / out["w0"]["sd"]
  assert out["w4"]["share_se_zero"] == 0.0  # every conditional draw is a wrong answer
  # shared prompts, cached decoding, fewer rows per scoring pass: the same measures from the same
  # seeds, up to float32 rounding
  for k in ("w4_s1", "w4_cached", "w4_s1_cached", "w4_r2", "w4_s1_cached_r2"):
    assert 0 <= out[k]["max_abs_diff_vs_w4"] < 1e-4, k
  assert not any(n.startswith("max_abs_diff") for n in out["w0"])
