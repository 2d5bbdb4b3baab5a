"""The LoRA-SFT baseline: reward-1 filtering, accumulated updates, the resumable run and export."""
import json
import os
import shutil
import signal

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from disa_jax import config as config_lib
from flax import nnx

from disa_jax import models, preemption
from disa_jax.estimators import load_stage1
from disa_jax.parallel import make_mesh
from disa_jax.estimators.dataset import Stage1Writer, build_records
from disa_jax.estimators.reward_transforms import RewardTransform
from disa_jax.data import packing
from disa_jax.sft import SupervisedSchedule, make_sft_step, sft_loss
from disa_jax.sft import baseline, lora
from disa_jax.testing import make_tiny_model, make_tokenizer, save_tiny_checkpoint

REWARDS = [[1.0, 0.0, 1.0, 0.5], [0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 1.0]]


def _write_stage1(path):
  tok = make_tokenizer()
  rng = np.random.default_rng(0)
  prompts = ["add 12 and 7", "what is 3 times 4", "sum of 5 and 9"]
  samples = []
  for p, rewards in enumerate(REWARDS):
    group = []
    for i, r in enumerate(rewards):
      text = f"answer {p}{i} {'yes' if r == 1.0 else 'no'}"
      ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
      group.append({"token_ids": ids, "text": text, "logp_ref": float(-rng.uniform(5, 9)),
                    "logp_proposal": float(-rng.uniform(5, 9)), "reward": r, "num_tokens": len(ids)})
    samples.append(group)
  recs = build_records([f"q{p}" for p in range(3)], prompts, samples, beta=2.0,
                       reward_transform=RewardTransform(kind="raw"))
  Stage1Writer(path).write(recs)
  return path


def test_filter_keeps_exactly_reward_one(tmp_path):
  data = load_stage1(_write_stage1(str(tmp_path / "s1.jsonl")))
  kept = baseline.filter_reward_one(data)
  want = [(f"q{p}", i) for p, rs in enumerate(REWARDS) for i, r in enumerate(rs) if r == 1.0]
  assert [(e.prompt_id, e.sample_index) for e in kept] == want
  for e in kept:
    rec = data.records[data.prompt_ids.index(e.prompt_id)]
    assert list(e.response_ids) == rec["samples"][e.sample_index]["token_ids"]
    assert e.prompt == rec["prompt"]
  assert [e.sample_index for e in baseline.filter_reward_one(data, 0.5)] == [3]


@pytest.mark.slow
def test_accumulated_step_equals_full_batch_step():
  """Packed micro-batches (several per update, sequences sharing rows) give the full padded
  batch's loss and update."""
  cfg = SupervisedSchedule(learning_rate=1e-2, total_steps=4, schedule="cosine", warmup_steps=0)
  rng = np.random.default_rng(2)
  lengths = [(3, 7), (3, 4), (3, 6), (3, 2)]
  prompts = [rng.integers(3, 60, p).tolist() for p, _ in lengths]
  responses = [rng.integers(3, 60, r).tolist() for _, r in lengths]
  padded = packing.pack(prompts, responses, packing.PackingLayout(packing=False, rows=4, pad_to=10),
                        pad_id=0)[0].rows
  full = {"input_ids": jnp.asarray(padded.input_ids), "attention_mask": jnp.asarray(padded.segment_ids),
          "response_mask": jnp.asarray(padded.response_mask)}
  micro = [b.rows for b in packing.pack(prompts, responses, packing.PackingLayout(
      row_len=16, rows=1, seqs_per_row=4), pad_id=0)]
  assert len(micro) == 2 and max(int(m.segment_ids.max()) for m in micro) == 2  # shared rows

  model = lora.apply_lora(make_tiny_model("qwen2", num_layers=1), lora.LoRAConfig(rank=4, alpha=8.0))
  graphdef, params, rest = nnx.split(model, lora.LoRAParam, ...)
  tx, full_step = make_sft_step(cfg, graphdef, loss="batch_mean")
  _, acc_step = make_sft_step(cfg, graphdef)  # 'token_mean'
  ref_params, ref_opt, opt_state = params, tx.init(params), tx.init(params)
  for _ in range(2):
    ref_params, ref_opt, want_loss = full_step(ref_params, ref_opt, rest, [full])
    params, opt_state, loss = acc_step(params, opt_state, rest, micro)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)
  # Adam divides by sqrt(v): float32 summation-order noise in the gradient shows up at ~1e-6.
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4),
               nnx.to_pure_dict(params), nnx.to_pure_dict(ref_params))


@pytest.mark.slow
def test_packed_sft_loss_equals_padded_loss_and_gradient():
  """`sft_loss` on packed rows (segment ids) = on padded rows, value and gradient (float32)."""
  rng = np.random.default_rng(3)
  lengths = [(2, 5), (4, 1), (1, 6), (3, 3), (5, 2)]
  prompts = [rng.integers(3, 60, p).tolist() for p, _ in lengths]
  responses = [rng.integers(3, 60, r).tolist() for _, r in lengths]
  padded = packing.pack(prompts, responses, packing.PackingLayout(packing=False, rows=5, pad_to=8),
                        pad_id=0)[0].rows
  (packed,) = packing.pack(prompts, responses, packing.PackingLayout(row_len=18, rows=2),
                           pad_id=0)
  assert packed.rows.input_ids.size < padded.input_ids.size
  model = make_tiny_model("qwen3", num_layers=1)
  grad = nnx.value_and_grad(lambda m, b: sft_loss(m, b["input_ids"], b.get("attention_mask"),
                                                  b["response_mask"],
                                                  segment_ids=b.get("segment_ids"),
                                                  positions=b.get("positions")))
  want, g_want = grad(model, {"input_ids": jnp.asarray(padded.input_ids),
                              "attention_mask": jnp.asarray(padded.segment_ids),
                              "response_mask": jnp.asarray(padded.response_mask)})
  rows = packed.rows
  got, g_got = grad(model, {k: jnp.asarray(getattr(rows, k)) for k in
                            ("input_ids", "segment_ids", "positions", "response_mask")})
  np.testing.assert_allclose(float(got), float(want), rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6),
               nnx.to_pure_dict(nnx.state(g_got)), nnx.to_pure_dict(nnx.state(g_want)))


def test_sft_batch_packs_each_example_of_the_batch_once():
  """Packing on or off, an update's micro-batches hold exactly the batch's examples (the same
  ones, fixed by seed and epoch), in micro-batches of a fixed number of rows."""
  rng = np.random.default_rng(4)
  lengths = [(int(rng.integers(2, 9)), int(rng.integers(1, 30))) for _ in range(13)]
  enc = baseline._EncodedExamples(  # pylint: disable=protected-access
      prompts=[rng.integers(3, 60, p).tolist() for p, _ in lengths],
      responses=[rng.integers(3, 60, r).tolist() for _, r in lengths], num_truncated=0,
      num_prompts=13)
  longest = max(p + r for p, r in lengths)
  for pack in (True, False):
    cfg = baseline.LoRASFTConfig(batch_size=6, micro_batch_rows=2, pad_to=8, packing=pack, seed=1)
    layout, most = cfg.layout(longest), 0
    for step in range(6):  # 3 updates per epoch (the last one wraps around), 2 epochs
      epoch, j = divmod(step, 3)
      order = np.random.default_rng([1, epoch]).permutation(13)
      want = np.concatenate([order, order])[j * 6:(j + 1) * 6]
      batches = baseline._sft_batch(step, 3, enc, cfg, layout, 0)  # pylint: disable=protected-access
      got = [want[i] for b in batches for i in b.seq_index[b.seq_index >= 0]]
      assert sorted(got) == sorted(want)
      assert all(b.rows.input_ids.shape[0] == 2 for b in batches)
      if pack:
        assert {b.row_len for b in batches} == {-(-longest // 8) * 8}  # one shape for the run
      most = max(most, max(int(b.rows.segment_ids.max()) for b in batches))
    assert most > 1 if pack else most == 1  # rows shared only with packing


def test_micro_batch_rows_round_up_to_the_mesh_batch_shards():
  cfg = baseline.LoRASFTConfig(micro_batch_rows=3)
  assert cfg.layout(40).rows == 3
  assert cfg.layout(40, shards=2).rows == 4  # fsdp=2: every device gets whole rows
  assert baseline.LoRASFTConfig(micro_batch_rows=8, packing=False).layout(40, shards=6).rows == 12


def test_config_validation():
  with pytest.raises(ValueError, match=r"row_len must be 0 or >= max_seq_len=64 .*, got 32"):
    baseline.LoRASFTConfig(max_seq_len=64, row_len=32)
  with pytest.raises(ValueError, match=r"micro_batch_rows must be >= 1, got 0"):
    baseline.LoRASFTConfig(micro_batch_rows=0)
  assert baseline.LoRASFTConfig(pad_to=16).layout(40).row_len == 48  # the longest, rounded up
  assert baseline.LoRASFTConfig(max_seq_len=64, row_len=100).layout(40).row_len == 100
  assert not baseline.LoRASFTConfig(packing=False).layout(40).packing
  with pytest.raises(ValueError, match="compute_dtype"):
    baseline.LoRASFTConfig(compute_dtype="fp8")
  with pytest.raises(ValueError, match=r"sft: unknown field\(s\) \['rnak'\]"):
    config_lib.from_mapping(baseline.LoRASFTConfig, {"rnak": 3}, "sft")
  with pytest.raises(ValueError, match="learning_rate must be > 0"):
    baseline.LoRASFTConfig(learning_rate=0.0)
  cfg = baseline.LoRASFTConfig()
  assert (cfg.rank, cfg.learning_rate, cfg.batch_size, cfg.epochs) == (64, 2e-5, 128, 3)
  assert config_lib.from_mapping(baseline.LoRASFTConfig, config_lib.to_dict(cfg)) == cfg


@pytest.mark.slow
def test_run_lora_sft_export_skip_and_resume(tmp_path):
  ref_path = save_tiny_checkpoint(str(tmp_path / "ref"), "qwen2")
  s1 = _write_stage1(str(tmp_path / "s1.jsonl"))
  out = str(tmp_path / "sft")
  cfg = baseline.LoRASFTConfig(rank=4, alpha=8.0, learning_rate=2e-2, batch_size=4,
                               micro_batch_rows=2, epochs=3, pad_to=16, checkpoint_every=1)
  mesh = make_mesh(data=1, fsdp=2, devices=jax.devices()[:2])  # weights + batch sharded
  summary = baseline.run_lora_sft(ref_path, s1, out, cfg, mesh=mesh)
  assert summary["num_kept"] == 5 and summary["num_prompts_with_kept"] == 2
  assert summary["num_samples"] == 11 and summary["num_truncated"] == 0
  assert summary["steps"] == 6 and summary["steps_per_epoch"] == 2 and not summary["skipped"]
  assert summary["loss_last"] < summary["loss_first"]
  assert summary["compute_dtype"] == "float32"
  # Packed rows of 16 tokens (the longest example rounded up to pad_to), 2 per micro-batch.
  assert 0.5 < summary["packing_efficiency"] <= 1.0 and summary["micro_batches_per_step"] >= 1
  exported = models.from_pretrained(out)
  ids = jnp.asarray([[5, 9, 11, 7, 12, 13, 14, 15]], jnp.int32)
  got = np.asarray(exported(ids))
  base = np.asarray(models.from_pretrained(ref_path)(ids))
  assert np.abs(got - base).max() > 1e-4
  assert os.path.exists(os.path.join(out, "tokenizer.json"))
  # A second call finds the export and does nothing.
  again = baseline.run_lora_sft(ref_path, s1, out, cfg)
  assert again["skipped"] and again["num_kept"] == 5
  # Export lost after training: the adapter checkpoint restores the trained state exactly.
  shutil.rmtree(out)
  baseline.run_lora_sft(ref_path, s1, out, cfg)  # no mesh this time: restores onto one device
  np.testing.assert_allclose(np.asarray(models.from_pretrained(out)(ids)), got, atol=1e-5, rtol=0)
  with open(os.path.join(out, baseline.SUMMARY_FILE)) as f:
    assert json.load(f)["loss_last"] == summary["loss_last"]
  # A different config cannot resume from that checkpoint.
  shutil.rmtree(out)
  with pytest.raises(ValueError, match="cannot resume"):
    baseline.run_lora_sft(ref_path, s1, out, baseline.LoRASFTConfig(
        rank=4, alpha=8.0, learning_rate=1e-2, batch_size=4, micro_batch_rows=2, epochs=3,
        pad_to=16))


@pytest.mark.slow
def test_sigusr1_saves_the_adapters_and_the_rerun_resumes_exactly(tmp_path):
  """A preemption signal during update 2 of 6: the run saves at step 2 (checkpoint_every = 0:
  only the preemption saves mid-run) and returns without an export; the rerun resumes there and
  its export equals an uninterrupted run's."""
  ref_path = save_tiny_checkpoint(str(tmp_path / "ref"), "qwen2")
  s1 = _write_stage1(str(tmp_path / "s1.jsonl"))
  cfg = baseline.LoRASFTConfig(rank=4, alpha=8.0, learning_rate=2e-2, batch_size=4,
                               micro_batch_rows=2, epochs=3, pad_to=16, checkpoint_every=0)
  want = baseline.run_lora_sft(ref_path, s1, str(tmp_path / "full"), cfg)

  def log(msg):  # the signal arrives after update 2, as from outside
    if msg.startswith("lora-sft: step 2/"):
      os.kill(os.getpid(), signal.SIGUSR1)

  out = str(tmp_path / "sft")
  with preemption.watch():
    first = baseline.run_lora_sft(ref_path, s1, out, cfg, log=log)
  assert first == {"preempted": 2, "out_path": out, "skipped": False}
  assert not os.path.exists(out) and sorted(os.listdir(out + ".ckpt")) == ["2"]
  messages = []
  second = baseline.run_lora_sft(ref_path, s1, out, cfg, log=messages.append)
  assert "lora-sft: resumed at step 2/6" in messages
  assert (second["loss_first"], second["loss_last"]) == (want["loss_first"], want["loss_last"])
  got, ref = models.to_hf_state_dict(models.from_pretrained(out)), models.to_hf_state_dict(
      models.from_pretrained(str(tmp_path / "full")))
  for k in ref:
    np.testing.assert_array_equal(got[k], ref[k], err_msg=k)


def test_paper_config_is_table_7():
  from configs import sft_paper as mod
  from disa_jax.workflows.sft import SftConfig
  for backbone in ("qwen2.5-7b", "qwen3-4b-base"):
    cfg = SftConfig.from_config(mod.get_config(backbone)).sft
    assert (cfg.rank, cfg.learning_rate, cfg.batch_size, cfg.epochs, cfg.max_seq_len) == (
        64, 2e-5, 128, 3, 18432)
    assert cfg.keep_reward == 1.0 and set(cfg.targets) == set(lora.ALL_TARGETS)
  with pytest.raises(ValueError, match="BACKBONE"):
    mod.get_config("llama-70b")
