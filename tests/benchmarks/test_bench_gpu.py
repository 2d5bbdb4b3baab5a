"""benchmarks/bench_gpu_train.py and bench_gpu_rollout.py on CPU with tiny models: the FLOP count,
bad inputs, the plan files they read, and one run of each measurement."""
import json

import jax
import pytest
from flax import nnx

from disa_jax import testing
from disa_jax.models.transformer import Transformer
from tests.benchmarks.scripts import load



bt = load("bench_gpu_train")
br = load("bench_gpu_rollout")
bw = load("bench_weight_push")


@pytest.mark.parametrize("tie", [True, False])
def test_matmul_params_are_the_models_kernels(tie):
  """N counts every kernel once (a tied head: the embedding; untied: the head, not the lookup)."""
  c = testing.tiny_config("qwen3", tie_word_embeddings=tie)
  model = nnx.eval_shape(lambda: Transformer(c, rngs=nnx.Rngs(0)))
  sizes = {jax.tree_util.keystr(p): v.size
           for p, v in jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param))[0]}
  kernels = sum(n for k, n in sizes.items() if "kernel" in k or "lm_head" in k)
  assert bt.matmul_params(c) == kernels + (sizes["['embed'].value"] if tie else 0)


def test_attention_flops_by_hand():
  c = testing.tiny_config("qwen3")  # 2 layers, 4 heads of 16
  # Sequences of 3 and 5 tokens: 6 + 15 causal pairs; 12 FLOPs per pair, layer, head and dim.
  assert bt.attention_flops(c, [3, 5]) == 12 * 2 * 4 * 16 * 21
  assert bt.useful_flops(c, [3, 5]) == 6 * bt.matmul_params(c) * 8 + 12 * 2 * 4 * 16 * 21


def test_bad_inputs_name_the_value(tmp_path):
  with pytest.raises(SystemExit, match="qwen3-0.6b:8k:on"):
    bt.Shape.parse("qwen3-0.6b:8k:on")
  with pytest.raises(ValueError, match="unknown model preset 'gpt2'"):
    bt.Shape.parse("gpt2:8192:on")
  with pytest.raises(SystemExit, match="must divide the row length 100"):
    bt.make_sequences(testing.tiny_config("qwen3"), 100, 8, 24, 32)
  plan = tmp_path / "plan.jsonl"
  plan.write_text(json.dumps(dict(model="m", row_len=64, rows=8, fsdp=1, remat=True)) + "\n")
  with pytest.raises(SystemExit, match=r"plan.jsonl:1: .* got rows=8 fsdp=1 remat=True"):
    bt.load_plans(str(plan))
  with pytest.raises(SystemExit, match="--prompts='8,x'"):
    br.parse_args(["--prompts", "8,x"])


def test_row_scaling_compares_each_row_length_with_the_shorter():
  rows = [dict(kind="train", model="m", remat=True, seq_len=32, row_len=n, step_s=s)
          for n, s in ((64, 1.0), (128, 3.0))]
  assert bt.row_scaling(rows + [dict(rows[0], row_len=256, error="OOM")]) == [
      "m              remat on  sequences of 32: row 64 -> 128: tokens x2.0, step time x3.00"]


@pytest.mark.slow
def test_measure_runs_the_trainers_update():
  """One packed row of 2 sequences through the paper config's update (~40 s on 2 busy cores)."""
  c = testing.tiny_config("qwen3")
  r = bt.measure(c, 64, True, prompt_len=8, response_len=24, steps=1, warmup=1)
  assert (r["tokens"], r["sequences"], r["seq_len"]) == (64, 2, 32)
  assert r["flops"] == bt.useful_flops(c, [32, 32]) and r["tflops"] > 0
  assert r["peak_bytes"] is None  # the CPU keeps no device statistics
  assert r["grad_norm"] > 0  # pi_old is the policy: importance weights 1, not clipped to 0
  assert len(r["step_s_all"]) == 2 and r["step_s"] == r["step_s_all"][1]
  assert r["attention_impl"] == "auto" and r["optimizer_step_argument_bytes"] > 0
  assert r["optimizer_step_temp_bytes"] >= 0


@pytest.mark.slow
def test_rollout_measurements(tmp_path):
  """Generation counts every token on both cache layouts; the push benchmark pushes the whole
  model both ways and both sample alike (~40 s)."""
  c = testing.tiny_config("qwen3")
  for layout in ("ragged", "dense"):
    g = br.generation(c, 2, layout=layout, prompt_len=8, group=4, new_tokens=16, reps=1)
    assert (g["rows"], g["decode_steps"]) == (8, 16)
    assert g["tokens_per_s"] == pytest.approx(8 * 16 / g["seconds"])
  assert g["layout"] == "dense" and "kv_cache_bytes" not in g
  s = bw.run("tiny", 0, "float32", reps=1, copy_threads=2, tmp=str(tmp_path),
             paths=("old", "flat", "flat_pinned"))
  assert s["same_greedy_samples"] and s["old_bytes"] > 0 and s["flat_bytes"] > 0
  assert s["last_path"] == "old" and set(s) >= {"speedup_push_flat", "speedup_push_flat_pinned"}
  for path in ("old", "flat", "flat_pinned"):
    assert s[f"{path}_push_s"] >= s[f"{path}_device_to_host_s"] + s[f"{path}_shm_s"]
