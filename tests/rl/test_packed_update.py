"""Packed micro-batches vs every sequence alone (no padding at all): the four objectives' losses and
gradients agree within 1e-5 in float32, on one device and sharded over 8, with and without shared
prompts; no recompilation across batches with different length mixes."""
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from disa_jax import parallel, testing
from disa_jax.data import packing
from disa_jax.rl import objectives
from disa_jax.rl import update as rl_update
from disa_jax.rl.logz_head import LogZHead
from disa_jax.scoring import gather_responses, packed_token_logprobs
from tests.rl.helpers import (alone_response_logp, grouped_sequences, micro_batches, packed_layout,
                              padded_layout, shared_layout, synthetic_sequences)

TINY = dict(num_layers=1, hidden_size=32, intermediate_size=64, num_heads=2, num_kv_heads=2)
OBJECTIVES = {"disa": objectives.Disa(beta=2.0, scale="mean", omega="clipped_ratio"),
              "flowrl": objectives.FlowRL(beta=2.0, scale="sum", omega="ratio", head_dropout=0.0),
              "grpo": objectives.Grpo(eps_high=0.28, kl_coef=0.01, loss_agg="token-mean"),
              "gspo": objectives.Gspo(eps_low=0.05, eps_high=0.05)}
ROW_LEN, MAX_RESPONSE = 16, 10
# (prompt, response) lengths: a one-token response, a sequence of exactly ROW_LEN tokens (a row to
# itself), an empty response (an invalid sequence: no loss, no weight), the rest mixed so that
# several sequences share rows and segment boundaries fall mid-row.
LENGTHS = [(3, 1), (6, 10), (2, 5), (4, 4), (1, 7), (5, 2), (3, 9), (2, 0),
           (4, 6), (7, 3), (2, 2), (6, 5)]
TOL = 1e-5
# Shared prompts, (prompt_len, [response lengths]) per prompt: the first group (5 + 20 tokens) is
# split into two units; one group is a full row; one has an empty and a one-token response; two
# small groups share a row; a group of one.
GROUPS = [(5, [1, 10, 0, 4, 3, 2]), (3, [5, 2, 6]), (2, [3, 1]), (4, [2]), (6, [7, 3]),
          (3, [9, 4])]


def _sequences(seed=0, lengths=LENGTHS):
  return synthetic_sequences(seed, len(lengths), 7, MAX_RESPONSE, vocab=128, lengths=lengths)


def _grouped(seed=0):
  return grouped_sequences(seed, GROUPS, MAX_RESPONSE, vocab=128)


def _models(method):
  model = testing.make_tiny_model(seed=0, **TINY)
  head = LogZHead(model.config.hidden_size, rngs=nnx.Rngs(1)) if method == "flowrl" else None
  return model, head


def _alone_loss(method, seqs):
  """(loss, (policy grads, head grads)) with every sequence run alone: [1, n_i] tokens, no
  padding, no segment ids; the loss reads the same [N, W] per-sequence layout."""
  obj = OBJECTIVES[method]
  model, head = _models(method)
  graphdef, params = nnx.split(model, nnx.Param)
  head_graphdef, head_params = nnx.split(head, nnx.Param) if head is not None else (None, None)
  prompts, responses = seqs.rollout.prompts, seqs.rollout.response_ids
  mask = (np.arange(MAX_RESPONSE)[None] <
          np.asarray([len(r) for r in responses])[:, None]).astype(np.float32)
  batch = types.SimpleNamespace(response_mask=mask, old_logp=seqs.old_logp,
                                ref_logp=seqs.ref_logp, signal=seqs.signal, log_z=seqs.log_z)

  def loss(params, head_params):
    m = nnx.merge(graphdef, params)
    logps, embs = [], []
    for p, r in zip(prompts, responses):
      ids = jnp.asarray(np.concatenate([p, r])[None])
      logits, hidden = m(ids, return_hidden=True)
      lp = jax.nn.log_softmax(logits[0, :-1].astype(jnp.float32), -1)
      tok = jnp.take_along_axis(lp, ids[0, 1:, None], -1)[:, 0][len(p) - 1:]  # response tokens
      logps.append(jnp.pad(tok, (0, MAX_RESPONSE - len(r))))
      pooled = hidden[0, :len(p) - 1].astype(jnp.float32)  # FlowRL: the prompt but its last token
      embs.append(pooled.mean(0) if len(p) > 1 else jnp.zeros(hidden.shape[-1]))
    head_log_z = None
    if head_graphdef is not None:
      head_log_z = nnx.merge(head_graphdef, head_params)(jnp.stack(embs))
    return obj.loss(jnp.stack(logps), batch, head_log_z)[0]

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(params, head_params)


def _packed_update(method, seqs, layout, mesh=None):
  """(loss metric, policy grads, head grads) of one update on packed micro-batches: SGD with
  lr 1 moves the parameters by exactly minus the gradient."""
  model, head = _models(method)
  if mesh is not None:
    parallel.shard_model(model, mesh, parallel.TRAIN_RULES)
  sgd = optax.sgd(1.0)
  graphdef, head_graphdef, state, shardings = rl_update.init_train_state(
      model, sgd, head, sgd if head is not None else None, mesh=mesh)
  step = rl_update.make_train_step(graphdef=graphdef, objective=OBJECTIVES[method], optimizer=sgd,
                                   obj_graphdef=head_graphdef,
                                   obj_optimizer=sgd if head is not None else None, mesh=mesh,
                                   state_shardings=shardings,
                                   options=rl_update.StepOptions(donate=False))
  micro = micro_batches(seqs, layout)
  if mesh is not None:
    micro = rl_update.place_micro_batches(micro, mesh)
  new, metrics = step(state, micro)
  moved = lambda a, b: jax.tree.map(lambda x, y: np.asarray(x) - np.asarray(y), a, b)
  return float(metrics["loss"]), moved(state.params, new.params), moved(state.obj_params,
                                                                        new.obj_params), micro


_ALONE: dict = {}  # (method, kind) -> the alone reference, computed once per module run


def _alone_reference(method, kind):
  """`_alone_loss` of KINDS[kind]'s sequences as numpy, shared by the tests that compare with it
  (it is deterministic: one device, fixed seeds; its unrolled per-sequence program is the costly
  compile of this module)."""
  if (method, kind) not in _ALONE:
    loss, grads = _alone_loss(method, KINDS[kind][0]())
    _ALONE[method, kind] = (float(loss), jax.tree.map(np.asarray, grads))
  return _ALONE[method, kind]


def _assert_close(method, kind, layout, mesh=None):
  seqs = KINDS[kind][0]()
  loss_ref, (g_ref, hg_ref) = _alone_reference(method, kind)
  loss, g, hg, micro = _packed_update(method, seqs, layout, mesh)
  assert len(micro) > 1  # the gradient is recombined from several micro-batches
  np.testing.assert_allclose(loss, float(loss_ref), rtol=TOL, atol=TOL)
  pairs = list(zip(jax.tree.leaves(g), jax.tree.leaves(g_ref)))
  pairs += list(zip(jax.tree.leaves(hg), jax.tree.leaves(hg_ref)))
  assert max(float(np.abs(np.asarray(b)).max()) for _, b in pairs) > 1e-3  # gradients are real
  for a, b in pairs:
    np.testing.assert_allclose(a, np.asarray(b), rtol=TOL, atol=TOL)


def _layout_logp(model, seqs, layout):
  """``[N, W]`` response-token log-probs of ``seqs`` computed on ``layout``'s rows."""
  out = np.zeros(seqs.old_logp.shape, np.float32)
  score = jax.jit(lambda rows, index, mask: gather_responses(packed_token_logprobs(model, rows),
                                                             index, mask))
  for b in packing.pack(seqs.rollout.prompts, seqs.rollout.response_ids, layout, pad_id=0):
    index, mask = b.response_index(MAX_RESPONSE)
    lp = np.asarray(score(jax.tree.map(jnp.asarray, b.rows), index, mask))  # [S, W]
    filled = b.seq_index >= 0
    out[b.seq_index[filled]] = lp[filled]
  return out


@pytest.mark.parametrize("method", ["disa", "grpo"])
@pytest.mark.slow
def test_packed_update_equals_padded_update(method):
  """Packing on vs off (one sequence per padded row): the same per-token log-probs, loss and
  gradients of one update, for a trajectory-balance objective and a clipped-ratio one."""
  seqs = _sequences()
  packed, padded = packed_layout(2, ROW_LEN), padded_layout(4)
  model, _ = _models(method)
  lp_packed, lp_padded = _layout_logp(model, seqs, packed), _layout_logp(model, seqs, padded)
  np.testing.assert_allclose(lp_packed, lp_padded, rtol=TOL, atol=TOL)
  np.testing.assert_allclose(lp_packed, alone_response_logp(model, seqs), rtol=TOL, atol=TOL)
  loss_p, g_p, _, micro_p = _packed_update(method, seqs, packed)
  loss_d, g_d, _, micro_d = _packed_update(method, seqs, padded)
  assert max(int(mb.rows.segment_ids.max()) for mb in micro_d) == 1  # padding: one per row
  assert max(int(mb.rows.segment_ids.max()) for mb in micro_p) > 1  # packing: rows shared
  computed = lambda micro: sum(mb.rows.input_ids.size for mb in micro)
  assert computed(micro_p) < computed(micro_d)  # fewer padding tokens computed
  np.testing.assert_allclose(loss_p, loss_d, rtol=TOL, atol=TOL)
  assert max(float(np.abs(x).max()) for x in jax.tree.leaves(g_d)) > 1e-3  # gradients are real
  for a, b in zip(jax.tree.leaves(g_p), jax.tree.leaves(g_d)):
    np.testing.assert_allclose(a, b, rtol=TOL, atol=TOL)


def test_layout_covers_the_edge_cases():
  seqs = _sequences()
  micro = micro_batches(seqs, packed_layout(2, ROW_LEN))
  rows = [r for mb in micro for r in np.asarray(mb.rows.segment_ids)]
  assert any(r.max() >= 2 and r.min() > 0 for r in rows)  # a full row of several sequences
  assert any((r == 1).all() for r in rows)  # one sequence of exactly ROW_LEN tokens
  assert sum(int(mb.response_mask.sum()) for mb in micro) == sum(r for _, r in LENGTHS)


# Each packing kind: its sequences and layout. "packed": one prompt copy per sequence (several
# sequences a row); "shared": the groups of GROUPS, each prompt once per unit.
KINDS = {"packed": (_sequences, packed_layout), "shared": (_grouped, shared_layout)}
METHODS = ["disa", "flowrl", "grpo", "gspo"]


@pytest.mark.parametrize("kind", ["packed", pytest.param("shared", marks=pytest.mark.slow)])
@pytest.mark.parametrize("method", [METHODS[0], *(pytest.param(m, marks=pytest.mark.slow)
                                                  for m in METHODS[1:])])
def test_packed_update_equals_every_sequence_alone(method, kind):
  _assert_close(method, kind, KINDS[kind][1](2, ROW_LEN))


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("method", METHODS)
def test_packed_update_sharded_equals_every_sequence_alone(method, kind, n_devices):
  assert n_devices == 8
  mesh = parallel.make_mesh(data=2, fsdp=2, tensor=2)
  _assert_close(method, kind, KINDS[kind][1](4, ROW_LEN), mesh)


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.slow
def test_packed_update_sharded_flowrl(kind):
  """The quick tier's sharded check (the head pools over rows split across devices; with shared
  prompts it reads each unit's prompt)."""
  mesh = parallel.make_mesh(data=2, fsdp=2, tensor=2)
  _assert_close("flowrl", kind, KINDS[kind][1](4, ROW_LEN), mesh)


def test_no_recompilation_across_length_mixes():
  model, _ = _models("grpo")
  sgd = optax.sgd(0.1)
  graphdef, _, state, _ = rl_update.init_train_state(model, sgd)
  step = rl_update.make_train_step(graphdef=graphdef, objective=OBJECTIVES["grpo"], optimizer=sgd)
  rng = np.random.default_rng(0)
  counts, n_micro = [], []
  for i in range(4):  # a different mix each time: short-heavy, long-heavy, mixed
    hi = (3, MAX_RESPONSE, 6, MAX_RESPONSE)[i]
    lengths = list(zip(rng.integers(1, 6, 16).tolist(), rng.integers(1, hi + 1, 16).tolist()))
    micro = micro_batches(synthetic_sequences(i, 16, 5, MAX_RESPONSE, 128, lengths=lengths),
                          packed_layout(2, ROW_LEN))
    n_micro.append(len(micro))
    state, _ = step(state, micro)
    counts.append(step.compiled_programs())
  assert len(set(n_micro)) > 1  # the number of micro-batches varied
  assert counts == [2] * 4, counts  # one micro step, one optimizer step, compiled once


def test_shared_layout_covers_the_edge_cases():
  seqs = _grouped()
  micro = micro_batches(seqs, shared_layout(2, ROW_LEN))
  rows = [r for mb in micro for r in np.asarray(mb.rows.segment_ids)]
  units = sum(len(set(r[r > 0].tolist())) for r in rows)
  assert units == len(GROUPS) + 1  # each prompt once, the first group's twice (two units)
  assert any(r.max() == 2 for r in rows)  # two units in one row
  assert sum(int(mb.response_mask.sum()) for mb in micro) == sum(sum(r) for _, r in GROUPS)
  real = sum(int((mb.rows.segment_ids > 0).sum()) for mb in micro)
  assert real == sum(p + sum(r) for p, r in GROUPS) + GROUPS[0][0]


@pytest.mark.parametrize("method", ["disa", "flowrl", "grpo", "gspo"])
def test_shared_prompt_update_equals_unshared_update(method):
  """Shared vs unshared packing of the same groups: the same log-probs, loss and gradients (the
  log Z head's included)."""
  seqs = _grouped()
  model, _ = _models(method)
  lp_shared = _layout_logp(model, seqs, shared_layout(2, ROW_LEN))
  np.testing.assert_allclose(lp_shared, _layout_logp(model, seqs, packed_layout(2, ROW_LEN)),
                             rtol=TOL, atol=TOL)
  loss_s, g_s, hg_s, micro_s = _packed_update(method, seqs, shared_layout(2, ROW_LEN))
  loss_u, g_u, hg_u, micro_u = _packed_update(method, seqs, packed_layout(2, ROW_LEN))
  real = lambda micro: sum(int((mb.rows.segment_ids > 0).sum()) for mb in micro)
  assert real(micro_s) < real(micro_u) and len(micro_s) > 1  # fewer prompt copies; accumulated
  np.testing.assert_allclose(loss_s, loss_u, rtol=TOL, atol=TOL)
  pairs = list(zip(jax.tree.leaves(g_s), jax.tree.leaves(g_u)))
  pairs += list(zip(jax.tree.leaves(hg_s), jax.tree.leaves(hg_u)))
  assert max(float(np.abs(b).max()) for _, b in pairs) > 1e-3  # gradients are real
  for a, b in pairs:
    np.testing.assert_allclose(a, b, rtol=TOL, atol=TOL)
