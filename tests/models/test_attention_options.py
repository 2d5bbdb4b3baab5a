"""The model's attention options: every implementation gives the model the same log-probs and
gradients on packed and shared-prompt rows; the remat policies give the gradients of no remat;
saving the attention's names keeps the backward from running the fused forward again; the options
are validated naming the field and reach the models the workflows build."""

import dataclasses
import logging

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from configs import stage3_paper
from disa_jax import config as config_lib
from disa_jax import testing
from disa_jax.data import packing
from disa_jax.models import (ModelOptions, Transformer, attention_dispatch, attention_pallas,
                             attention_xla, transformer)
from disa_jax.sft.baseline import LoRASFTConfig
from disa_jax.workflows import stage3

from .attention_cases import CASES, layout, max_rel_err, qkv


def _rows(case):
  seg, br = CASES[case]()
  ids = jnp.asarray(np.random.default_rng(7).integers(3, 120, size=seg.shape), jnp.int32)
  pos = np.zeros_like(seg)
  for b in range(seg.shape[0]):  # positions restart per segment; responses continue the prompt
    for s in set(seg[b]) - {0}:
      cols = np.flatnonzero(seg[b] == s)
      if br is None:
        pos[b, cols] = np.arange(len(cols))
      else:
        prompt = cols[br[b, cols] == 0]
        pos[b, prompt] = np.arange(len(prompt))
        for r in set(br[b, cols]) - {0}:
          rc = cols[br[b, cols] == r]
          pos[b, rc] = len(prompt) + np.arange(len(rc))
  return ids, jnp.asarray(seg), None if br is None else jnp.asarray(br), jnp.asarray(pos)


def _loss_and_grads(model, case):
  """The mean log-prob of the next token over the rows' real tokens, and its gradients."""
  ids, seg, br, pos = _rows(case)

  def loss(m):
    logits = m(ids, segment_ids=seg, branch_ids=br, positions=pos)[:, :-1]
    logp = jnp.take_along_axis(jax.nn.log_softmax(logits), ids[:, 1:, None], axis=-1)[..., 0]
    real = (seg[:, 1:] > 0).astype(jnp.float32)
    return jnp.sum(logp * real) / jnp.sum(real)

  return nnx.jit(nnx.value_and_grad(loss))(model)


@pytest.fixture(scope="module")
def dense_model_grads():
  model = testing.make_tiny_model("qwen3", seed=3)
  model.options = dataclasses.replace(model.options, attention_impl="dense")
  return _loss_and_grads(model, "branches")


@pytest.mark.parametrize("impl,window", [("xla", 12), ("pallas", 0)])
@pytest.mark.slow
def test_implementations_give_the_model_the_same_gradients(monkeypatch, impl, window,
                                                           dense_model_grads):
  """'xla' (with the band at the longest unit: 12 tokens) and 'pallas' (interpreted) against
  'dense' on the tiny Qwen3 model (4 query heads over 2 key/value heads) over shared-prompt rows:
  the loss and every parameter's gradient, to float32 rounding through two layers (each attention
  alone agrees to 1e-6: test_attention_xla.py, test_attention_pallas.py). A spy checks that the
  model really ran ``impl``'s function, once per layer, with the band."""
  module, name = {"xla": (attention_xla, "xla_attention"),
                  "pallas": (attention_pallas, "pallas_attention")}[impl]
  calls = []
  original = getattr(module, name)

  def spy(*args, **kwargs):
    calls.append(kwargs.get("window"))
    return original(*args, **kwargs)

  monkeypatch.setattr(module, name, spy)
  model = testing.make_tiny_model("qwen3", seed=3)
  model.options = dataclasses.replace(model.options, attention_impl=impl,
                                      max_segment_len=window)
  assert max_rel_err(_loss_and_grads(model, "branches"), dense_model_grads) <= 1e-5
  assert calls == [window if impl == "xla" else None] * model.config.num_layers


@pytest.fixture(scope="module")
def no_remat():
  return _loss_and_grads(testing.make_tiny_model("qwen3", seed=4), "short")


@pytest.mark.parametrize("policy", config_lib.REMAT_POLICIES)
@pytest.mark.slow
def test_remat_policies_give_the_gradients_of_no_remat(policy, no_remat):
  model = testing.make_tiny_model("qwen3", seed=4)
  model.options = dataclasses.replace(model.options, remat=True, remat_policy=policy)
  assert max_rel_err(_loss_and_grads(model, "short"), no_remat) <= 1e-6


def _compiled_loops(policy):
  """While loops in the compiled loss and gradients of a layer-like function around the Pallas
  attention (the interpreter runs each kernel as loops), under ``policy`` (None: no remat)."""
  q, k, v, _ = qkv(seed=8)
  lay = layout(CASES["short"]()[0])

  def f(q, k, v):
    q, k, v = (checkpoint_name(a, name) for a, name in zip((q, k, v), transformer.ATTN_NAMES))
    out = attention_pallas.pallas_attention(q, k, v, lay, block_q=8, block_k=8, interpret=True)
    return jnp.sum(checkpoint_name(out, "attn_out") ** 2)

  if policy is not None:
    f = jax.checkpoint(f, policy=transformer.remat_policy(policy))
  step = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))
  return step.lower(q, k, v).compile().as_text().count(" while(")


def test_saving_the_attention_skips_its_forward_in_the_backward():
  """'save_attn' keeps the output and the kernel's log-sum-exp (the policies above it keep more):
  the backward needs no forward kernel, and the program has the loops of no remat at all; 'full'
  runs the forward kernel again in the backward (more loops)."""
  loops = {policy: _compiled_loops(policy) for policy in (None, "save_attn", "full")}
  assert loops[None] == loops["save_attn"] < loops["full"]


def test_the_model_refuses_rows_longer_than_its_band():
  """Concrete segment ids are checked at once; traced ones (under jit) give the row NaN logits."""
  model = testing.make_tiny_model("qwen3", seed=6)  # the band is 'xla''s ('auto' is dense here)
  model.options = dataclasses.replace(model.options, max_segment_len=11, attention_impl="xla")
  ids, seg, _, _ = _rows("packed")  # row 1: one segment of 20 tokens
  with pytest.raises(ValueError, match=r"max_segment_len=11: row 1 holds a segment of 20 tokens"):
    model(ids, segment_ids=seg)
  run = nnx.jit(lambda m, ids, seg: m(ids, segment_ids=seg))
  logits = np.asarray(run(model, ids, seg))
  assert np.isfinite(logits[0]).all() and np.isnan(logits[1]).all()
  model.options = dataclasses.replace(model.options, max_segment_len=20)
  assert np.isfinite(np.asarray(run(model, ids, seg))).all()


def test_options_are_validated_naming_the_field():
  config = testing.tiny_config("qwen3")
  for kwargs, match in ((dict(attention_impl="flash"), "Transformer attention_impl must be one of"),
                        (dict(remat_policy="most"), "Transformer remat_policy must be one of"),
                        (dict(max_segment_len=-1), "Transformer max_segment_len must be an int"),
                        (dict(max_segments=1.5), "Transformer max_segments must be an int")):
    with pytest.raises(ValueError, match=match):
      Transformer(config, rngs=nnx.Rngs(0), options=ModelOptions(**kwargs))
  c = stage3_paper.get_config("disa,qwen3-4b-base,math").to_dict()
  c["model"]["remat_policy"] = "most"
  with pytest.raises(ValueError, match=r"model.remat_policy must be one of .* got 'most'"):
    stage3.Stage3Config.from_config(c)


def test_stage3_builds_its_models_with_the_options(tmp_path):
  ckpt = testing.save_tiny_checkpoint(str(tmp_path / "tiny"), "qwen3")
  c = stage3_paper.get_config("disa,qwen3-4b-base,math").to_dict()
  assert (c["model"]["attention_impl"], c["model"]["remat_policy"]) == ("auto", "full")
  c["model"].update(policy_path=ckpt, attention_impl="pallas", remat_policy="save_qkv_attn")
  cfg = stage3.Stage3Config.from_config(c)
  policy, reference = stage3._load_models(cfg, None)  # pylint: disable=protected-access
  assert (policy.options.attention_impl, policy.options.remat_policy) == ("pallas", "save_qkv_attn")
  assert reference.options.attention_impl == "pallas"
  assert (policy.options.max_segments == reference.options.max_segments
          == cfg.train.rollout.seqs_per_row)
  # rows of one longest sequence
  assert policy.options.max_segment_len == reference.options.max_segment_len == 0


def test_stage3_and_sft_give_the_band_their_longest_sequence(tmp_path):
  """Rows longer than the longest sequence (prompt + response limits): the models get that bound
  as ``max_segment_len`` (the 'xla' band), and the packing refuses a longer segment on the host
  (the model would give its row NaN under jit). Shared prompts (a unit may fill its row) and
  rows of one longest sequence get no band."""
  ckpt = testing.save_tiny_checkpoint(str(tmp_path / "tiny"), "qwen3")
  c = stage3_paper.get_config("disa,qwen3-4b-base,math").to_dict()
  c["model"].update(policy_path=ckpt)
  rollout = c["train"]["rollout"]
  rollout.update(max_prompt_len=16, max_response_len=48, row_len=256)
  cfg = stage3.Stage3Config.from_config(c)
  policy, reference = stage3._load_models(cfg, None)  # pylint: disable=protected-access
  assert policy.options.max_segment_len == reference.options.max_segment_len == 64
  layout = cfg.train.rollout.layout([64], pad_to=16)
  assert (layout.row_len, layout.max_segment_len) == (256, 64)
  packing.pack([[3] * 16], [[4] * 48], layout, pad_id=0)
  with pytest.raises(ValueError, match=r"sequence 1 has 65 tokens > max_segment_len=64"):
    packing.pack([[3] * 16, [3] * 17], [[4] * 8, [4] * 48], layout, pad_id=0)
  rollout.update(share_prompts=True)
  assert stage3.Stage3Config.from_config(c).train.rollout.max_segment_len == 0
  rollout.update(share_prompts=False, row_len=0)
  assert stage3.Stage3Config.from_config(c).train.rollout.max_segment_len == 0
  sft = LoRASFTConfig(max_seq_len=64, row_len=256)
  assert sft.max_segment_len == sft.layout(64).max_segment_len == 64
  assert LoRASFTConfig(max_seq_len=64, packing=False).max_segment_len == 0


def test_query_chunks_keep_no_copies_of_q_k_v_under_a_remat_policy(capsys):
  """The chunked 'xla' attention under 'save_qkv_attn': what the remat saves is the four named
  activations, not a copy of q, k and v per chunk."""
  q, k, v, _ = qkv(seed=10)
  lay = layout(CASES["short"]()[0])

  def f(q, k, v, lay):
    q, k, v = (checkpoint_name(a, name) for a, name in zip((q, k, v), transformer.ATTN_NAMES))
    out = attention_xla.xla_attention(q, k, v, lay, chunk=8)
    return jnp.sum(checkpoint_name(out, "attn_out") ** 2)

  policy = transformer.remat_policy("save_qkv_attn")
  jax.ad_checkpoint.print_saved_residuals(jax.checkpoint(f, policy=policy), q, k, v, lay)
  saved = [line for line in capsys.readouterr().out.splitlines()
           if "from a constant" not in line and "from the argument lay" not in line]
  assert len(saved) == 4 and all(" named 'attn_" in line for line in saved), saved


def test_an_explicit_fused_impl_warns_once_when_it_falls_back(caplog):
  """'cudnn' / 'splash' asked for by name but unable to run a call run it on 'xla' and say why,
  once per reason; 'auto' falls back silently."""
  resolve = attention_dispatch.resolve_impl
  attention_dispatch._warn_fallback.cache_clear()  # pylint: disable=protected-access
  with caplog.at_level(logging.WARNING, logger=attention_dispatch.__name__):
    assert resolve("auto", backend="gpu", dtype=jnp.float32, head_dim=64, branches=False) == "xla"
    assert resolve("auto", backend="tpu", dtype=jnp.bfloat16, head_dim=64, branches=True) == "xla"
    assert not caplog.records
    for _ in range(2):
      assert resolve("cudnn", backend="gpu", dtype=jnp.float32, head_dim=64,
                     branches=False) == "xla"
      assert resolve("splash", backend="tpu", dtype=jnp.bfloat16, head_dim=64,
                     branches=True) == "xla"
  messages = [r.getMessage() for r in caplog.records]
  assert len(messages) == 2, messages
  assert "attention_impl='cudnn'" in messages[0] and "dtype float32" in messages[0]
  assert "attention_impl='splash'" in messages[1] and "branch" in messages[1]
  assert all("running it on 'xla'" in m for m in messages)


def test_auto_runs_short_rows_dense_and_long_ones_on_xla_on_a_cpu(monkeypatch):
  """'auto' on a CPU: 'dense' up to `CPU_DENSE_MAX_ROW` tokens a row (faster there), 'xla' beyond
  it or when the row length is not known; a name asked for is kept. The model passes its rows'
  length: on 20-token rows 'auto' never calls the block loop and gives the dense model's logits
  bit for bit."""
  resolve = attention_dispatch.resolve_impl
  limit = attention_dispatch.CPU_DENSE_MAX_ROW
  kw = dict(backend="cpu", dtype=jnp.float32, head_dim=16, branches=True)
  assert resolve("auto", row_len=72, **kw) == "dense"
  assert resolve("auto", row_len=limit, **kw) == "dense"
  assert resolve("auto", row_len=limit + 1, **kw) == "xla"
  assert resolve("auto", **kw) == "xla"
  assert resolve("xla", row_len=72, **kw) == "xla"
  calls = []
  original = attention_xla.xla_attention
  monkeypatch.setattr(attention_xla, "xla_attention",
                      lambda *a, **k: calls.append(1) or original(*a, **k))
  ids, seg, br, pos = _rows("branches")
  logits = {}
  for impl in ("auto", "dense"):
    model = testing.make_tiny_model("qwen3", seed=3)
    model.options = dataclasses.replace(model.options, attention_impl=impl)
    logits[impl] = np.asarray(model(ids, segment_ids=seg, branch_ids=br, positions=pos))
  assert ids.shape[1] <= limit and not calls
  np.testing.assert_array_equal(logits["auto"], logits["dense"])
