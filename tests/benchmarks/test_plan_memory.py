"""benchmarks/plan_memory.py on a small model and the suite's 8 fake CPU devices: the compiled
memory analysis of the Stage 3 programs obeys what sharding and batch size imply."""
import dataclasses
import json
import pathlib

import jax
import pytest

from disa_jax import parallel, testing
from tests.benchmarks.scripts import load

ROOT = pathlib.Path(__file__).resolve().parents[2]
pm = load("plan_memory")

# Large enough that the parameters dominate the arguments; every sharded axis divides by 8.
SMALL = dict(hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4, num_kv_heads=2,
             head_dim=64)
ROW_LEN, CHUNK = 64, 32


@pytest.fixture(scope="module")
def settings():
  train, mc = pm.paper_train_config("qwen3-4b-base")  # the paper's optimizer, objective, dtypes
  rollout = dataclasses.replace(train.rollout, max_prompt_len=16, max_response_len=48,
                                seqs_per_row=4)
  return dataclasses.replace(train, rollout=rollout), mc


def _setup(settings, fsdp):
  train, mc = settings
  mesh = parallel.make_mesh(1, fsdp, 1, devices=jax.devices()[:fsdp])
  return pm.programs_for("small", testing.tiny_config("qwen3", **SMALL), train, mc, mesh, CHUNK)


@pytest.fixture(scope="module")
def sharded(settings, n_devices):
  """Two micro-batch sizes on fsdp = 8 (two micro-step compilations, one optimizer step, one
  scoring pass)."""
  assert n_devices == 8
  setup = _setup(settings, 8)
  return setup, [pm.plan(setup, rows=8, row_len=ROW_LEN),
                 pm.plan(setup, rows=16, row_len=ROW_LEN, with_score=False)]


@pytest.mark.slow
def test_memory_grows_with_tokens(sharded):
  _, (base, more_rows) = sharded
  assert more_rows.tokens == 2 * base.tokens
  assert more_rows.micro.temp > base.micro.temp and more_rows.peak > base.peak
  assert base.score is not None and base.score.peak < base.micro.peak  # no gradient, no accumulator


@pytest.mark.slow
def test_memory_grows_with_row_length(sharded):
  setup, (base, _) = sharded
  longer = pm.plan(setup, rows=8, row_len=2 * ROW_LEN, with_score=False)
  assert longer.tokens == 2 * base.tokens and longer.micro.temp > base.micro.temp


def test_arguments_are_the_sharded_state(sharded):
  """Per device: params + AdamW m, v + the gradient accumulator ~ 4 x the f32 params / 8."""
  setup, (base, *_) = sharded
  params_total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(setup.state.params))
  params_dev = pm.device_bytes(setup.state.params)
  assert params_dev < 0.15 * params_total  # sharded: ~1/8 (norms are replicated)
  assert base.adam_bytes == pytest.approx(2 * params_dev, rel=0.01)
  assert base.optim.argument == pytest.approx(4 * params_total / 8, rel=0.1)
  assert base.micro.argument >= 2 * params_dev  # params + accumulator (+ the batch)
  assert base.micro.output - base.micro.alias < 0.01 * base.micro.output  # accumulator donated
  assert base.ref_bytes == pytest.approx(params_dev / 2, rel=0.01)  # bf16 copy of f32 params


@pytest.mark.slow
def test_fsdp_8_needs_less_than_one_device(settings, sharded):
  _, (base, *_) = sharded
  single = pm.plan(_setup(settings, 1), rows=8, row_len=ROW_LEN, with_score=False)
  assert single.optim.argument > 6 * base.optim.argument
  assert single.peak > 2 * base.peak


def test_largest_fit_and_table(sharded):
  setup, plans = sharded
  capacity = (plans[0].peak_with_ref + plans[1].peak_with_ref) // 2  # 8 rows fit, 16 do not
  best = pm.largest_fit(setup, plans, row_len=ROW_LEN, capacity=capacity, log=lambda _: None)
  assert best.rows == 8 and best.peak_with_ref <= capacity
  assert pm.largest_fit(setup, plans, row_len=ROW_LEN, capacity=1, log=lambda _: None) is None
  table = pm.format_table(plans, capacity).splitlines()
  assert len(table) == 2 + len(plans) and "fits" in table[0]
  assert table[2].rstrip(" |").endswith("yes") and table[3].rstrip(" |").endswith("NO")


def test_bad_sizes_are_named(sharded):
  setup, _ = sharded
  with pytest.raises(ValueError, match="--rows value 12"):
    pm.plan(setup, rows=12, row_len=ROW_LEN)
  with pytest.raises(SystemExit, match="--rows='8,x'"):
    pm.parse_args(["--rows", "8,x"])
  with pytest.raises(SystemExit, match="--attention-chunk=-1: must be >= 0"):
    pm.parse_args(["--attention-chunk", "-1"])


def test_attention_chunk_comes_from_the_paper_config(n_devices):
  """No flag: the Stage 3 paper config's model.attention_chunk (1024); the flag overrides it."""
  assert pm.parse_args([]).attention_chunk is None
  assert pm.paper_train_config("qwen3-4b-base")[1].attention_chunk == 1024
  assert pm.make_programs("qwen3-4b-base", fsdp=n_devices).attention_chunk == 1024  # abstract: no compile
  assert pm.make_programs("qwen3-4b-base", fsdp=n_devices, attention_chunk=0).attention_chunk == 0
  assert "model.attention_chunk=1024" in pm.stage3_notes("qwen3-4b-base")[0]


def test_plan_record_is_the_plans_json_line(sharded):
  """What `plan_memory.py --json` writes and `bench_gpu_train.py --plan` compares against."""
  _, (base, _) = sharded
  rec = json.loads(json.dumps(pm.plan_record(base, remat=False)))
  assert rec["micro"] == base.micro.peak + base.adam_bytes and rec["peak"] == base.peak
  assert (rec["rows"], rec["fsdp"], rec["remat"]) == (8, 8, False)


def test_settings_of_another_backbone():
  """A preset that is no paper backbone needs --settings-of; --remat overrides the config's."""
  with pytest.raises(ValueError, match="config BACKBONE must be one of"):
    pm.make_programs("qwen3-0.6b", fsdp=1)
  args = pm.parse_args(["--models", "qwen3-0.6b", "--settings-of", "qwen3-4b-base", "--no-remat"])
  assert (args.settings_of, args.remat) == ("qwen3-4b-base", False)


@pytest.mark.slow  # one more micro-step compilation (~15 s of CPU, 40 s on the shared machine)
def test_remat_policies_are_planned(settings, sharded):
  """A policy that keeps q, k, v, the attention output and the MLP projections needs more
  temporaries than 'full' (which keeps each layer's input only); the plan says which it compiled,
  and the attention is what 'auto' runs rows of 64 tokens with on a CPU ('dense'; 'xla' beyond 256
  tokens)."""
  train, mc = settings
  _, (base, _) = sharded
  assert (base.attention_impl, base.remat_policy) == ("dense", "full")
  mesh = parallel.make_mesh(1, 8, 1, devices=jax.devices()[:8])
  saving = pm.programs_for("small", testing.tiny_config("qwen3", **SMALL), train,
                        dataclasses.replace(mc, remat_policy="save_qkv_attn_mlp"), mesh, CHUNK)
  more = pm.plan(saving, rows=8, row_len=ROW_LEN, with_score=False)
  assert more.remat_policy == "save_qkv_attn_mlp" and more.micro.temp > base.micro.temp
  rec = pm.plan_record(more, remat=True)
  assert (rec["attention_impl"], rec["remat_policy"]) == ("dense", "save_qkv_attn_mlp")
  assert pm.table_row(more, 1 << 40)[5:7] == ("dense/32", "save_qkv_attn_mlp")


def test_remat_policy_flags():
  args = pm.parse_args(["--remat-policy", "full, save_qkv_attn", "--attention-impl", "dense"])
  assert (args.remat_policies, args.attention_impl) == (["full", "save_qkv_attn"], "dense")
  assert pm.parse_args([]).remat_policies == [None]  # the config's
  with pytest.raises(SystemExit, match="--remat-policy must be one of .* got 'most'"):
    pm.parse_args(["--remat-policy", "full,most"])
  with pytest.raises(SystemExit, match="--no-remat with --remat-policy=full,save_attn"):
    pm.parse_args(["--no-remat", "--remat-policy", "full,save_attn"])


def test_gpu_flags_and_the_committed_tables():
  """--card takes every attention implementation (the CPU proxy: auto / xla / dense, one); the
  committed XLA:GPU tables print as docs/cluster.md quotes them, every 4B/16k cuDNN plan with its
  16 segment slots and no T^2 buffer."""
  args = pm.parse_args(["--card", "h200", "--attention-impl", "auto,cudnn,dense"])
  assert (args.attention_impls, args.fsdp, args.topology) == (["auto", "cudnn", "dense"], None,
                                                              "1x1x1")
  with pytest.raises(SystemExit, match="--attention-impl='cudnn': expected one of"):
    pm.parse_args(["--attention-impl", "cudnn"])
  with pytest.raises(SystemExit, match="one implementation without --card"):
    pm.parse_args(["--attention-impl", "xla,dense"])
  results = sorted((ROOT / "benchmarks" / "results").glob("gpu_compile_train_*.json"))
  table = pm.format_gpu_tables([str(p) for p in results]).splitlines()
  assert len(table) == 2 + sum(len(json.loads(p.read_text())["plans"]) for p in results)
  cudnn = [json.loads(p.read_text()) for p in results]
  cudnn = [r for out in cudnn for r in out["plans"] if r.get("attention_impl") == "cudnn"]
  assert cudnn and all(r["programs"]["micro"]["facts"]["cudnn_segment_slots"] == [16]
                       and not any("T^2" in c for c in r["checks"]) for r in cudnn)
