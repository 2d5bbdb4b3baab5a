"""The jitted update (`disa_jax.rl.update.make_train_step`): exact accumulation, all methods,
sharded == single device."""
import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from disa_jax import config as config_lib
from disa_jax import optim, parallel, testing
from disa_jax.rl import losses, objectives
from disa_jax.rl import update as rl_update
from disa_jax.rl.config import TrainConfig
from disa_jax.rl.logz_head import LogZHead
from tests.rl.helpers import (alone_response_logp, micro_batches, packed_layout, padded_layout,
                              synthetic_sequences)

OBJECTIVES = {"disa": objectives.Disa(beta=2.0, scale="mean", omega="clipped_ratio"),
              "flowrl": objectives.FlowRL(beta=2.0, scale="mean", omega="clipped_ratio",
                                          head_dropout=0.0),
              "grpo": objectives.Grpo(eps_high=0.28, kl_coef=0.01),
              "gspo": objectives.Gspo()}

ROWS, MAX_PROMPT, MAX_RESPONSE = 16, 4, 8
TINY = dict(num_layers=1, hidden_size=32, intermediate_size=64, num_heads=2, num_kv_heads=2)
NO_DONATE = rl_update.StepOptions(donate=False)



def _init_params():
  return nnx.state(testing.make_tiny_model(seed=0, **TINY), nnx.Param)


def _setup(method, mesh=None, adamw=False):
  model = testing.make_tiny_model(seed=0, **TINY)
  if mesh is not None:
    parallel.shard_model(model, mesh, parallel.TRAIN_RULES)
  # Plain SGD makes parameter differences proportional to gradient differences; AdamW's
  # normalisation amplifies rounding in near-zero gradients to O(lr) and is checked separately.
  if adamw:
    opt = rl_update.make_optimizer(1e-3, weight_decay=0.01, grad_clip=1.0)
  else:
    opt = optax.sgd(0.5)
  head = head_opt = None
  if method == "flowrl":
    head = LogZHead(model.config.hidden_size, rngs=nnx.Rngs(1))
    head_opt = rl_update.make_optimizer(1e-2, grad_clip=1.0)
  graphdef, head_graphdef, state, shardings = rl_update.init_train_state(model, opt, head, head_opt,
                                                                         mesh=mesh)
  return graphdef, head_graphdef, state, shardings, OBJECTIVES[method], opt, head_opt


def _seqs(seed, invalid_rows=0):
  return synthetic_sequences(seed, ROWS, MAX_PROMPT, MAX_RESPONSE, vocab=128,
                             invalid_rows=invalid_rows)


def _run(method, layout, steps=2, mesh=None, invalid_rows=0, adamw=False):
  """``steps`` updates, each on ROWS synthetic sequences laid out by ``layout``."""
  graphdef, head_graphdef, state, shardings, settings, opt, head_opt = _setup(method, mesh, adamw)
  step = rl_update.make_train_step(graphdef=graphdef, objective=settings, optimizer=opt,
                                   obj_graphdef=head_graphdef, obj_optimizer=head_opt, mesh=mesh,
                                   state_shardings=shardings)
  all_metrics = []
  for i in range(steps):
    micro = micro_batches(_seqs(i, invalid_rows), layout)
    if mesh is not None:
      micro = rl_update.place_micro_batches(micro, mesh)
    state, metrics = step(state, micro)
    all_metrics.append(jax.tree.map(float, metrics))
  return state, all_metrics


def _assert_states_close(a, b, tol):
  """Max |a - b| over params, relative to the largest parameter change made by the updates."""
  flat_a = jax.tree.leaves(a.params) + jax.tree.leaves(a.obj_params)
  flat_b = jax.tree.leaves(b.params) + jax.tree.leaves(b.obj_params)
  flat_0 = jax.tree.leaves(_init_params())
  assert len(flat_a) == len(flat_b)
  worst = max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in
              zip(flat_a, flat_b))
  moved = max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in
              zip(flat_a, flat_0))
  assert moved > 1e-3, moved
  assert worst / moved < tol, (worst, moved)
  return worst, moved


def _assert_metrics_close(ma, mb, tol):
  for sa, sb in zip(ma, mb):
    assert sa.keys() == sb.keys()
    for k in sa:
      np.testing.assert_allclose(sa[k], sb[k], rtol=tol, atol=tol, err_msg=k)


@pytest.mark.parametrize("method", [
    "flowrl",
    pytest.param("disa", marks=pytest.mark.slow),
    pytest.param("grpo", marks=pytest.mark.slow),
    pytest.param("gspo", marks=pytest.mark.slow)])
def test_accumulation_matches_one_big_micro_batch(method):
  # 3 invalid (no-response) rows: the valid-count weighting must still give the exact mean.
  s1, m1 = _run(method, padded_layout(ROWS), steps=1, invalid_rows=3)
  s4, m4 = _run(method, padded_layout(4), steps=1, invalid_rows=3)
  # Packed: 3 micro-batches of 2 rows x 12 tokens, the last one partly empty.
  sp, mp = _run(method, packed_layout(2, MAX_PROMPT + MAX_RESPONSE), steps=1, invalid_rows=3)
  for s_other, m_other in ((s4, m4), (sp, mp)):
    _assert_states_close(s1, s_other, 1e-4)
    for k in ("loss", "grad_norm", "num_sequences"):
      np.testing.assert_allclose(m1[0][k], m_other[0][k], rtol=1e-4, err_msg=k)
  assert m1[0]["num_sequences"] == ROWS - 3
  assert int(s4.step) == 1
  if method == "flowrl":
    assert m1[0]["objective_grad_norm"] > 0
    # The head is its own state: the policy's params hold no head variable.
    assert s1.obj_params is not None
    assert len(jax.tree.leaves(s1.params)) == len(
        jax.tree.leaves(nnx.state(testing.make_tiny_model(**TINY), nnx.Param)))
  else:
    assert s1.obj_params is None


def test_params_change_and_metrics_present():
  graphdef, _, state0, _, settings, opt, _ = _setup("disa")
  before = jax.tree.map(np.asarray, state0.params)
  state, metrics = _run("disa", packed_layout(4, MAX_PROMPT + MAX_RESPONSE), steps=1,
                        adamw=True)
  diff = max(float(np.abs(np.asarray(a) - b).max()) for a, b in
             zip(jax.tree.leaves(state.params), jax.tree.leaves(before)))
  assert diff > 0
  for k in ("loss", "tb_residual_mean", "tb_residual_std", "log_z_mean", "omega_mean",
            "grad_norm"):
    assert np.isfinite(metrics[0][k]), k


def test_sharded_step_equals_single_device(n_devices):
  assert n_devices == 8
  mesh = parallel.make_mesh(data=2, fsdp=2, tensor=2)
  for method, adamw, tol in (("flowrl", False, 1e-4),):
    layout = packed_layout(4, MAX_PROMPT + MAX_RESPONSE)  # rows over data x fsdp = 4 shards
    single, m_single = _run(method, layout, steps=2, adamw=adamw)
    sharded, m_sharded = _run(method, layout, steps=2, mesh=mesh, adamw=adamw)
    worst, moved = _assert_states_close(single, sharded, tol)
    _assert_metrics_close(m_single, m_sharded, 2e-4)
    # Parameters stay sharded as the model was placed.
    emb = sharded.params["embed"][...]
    assert len(emb.sharding.device_set) == 8 and not emb.sharding.is_fully_replicated
    print(f"{method} ({'adamw' if adamw else 'sgd'}): max |sharded - single| param diff after "
          f"2 steps = {worst:.3g} (largest parameter change {moved:.3g})")


def test_adamw_moments_are_sharded_like_their_parameters(n_devices):
  """Before `opt_state_shardings`, jit(optimizer.init) replicated mu and nu on every device."""
  mesh = parallel.make_mesh(fsdp=n_devices)

  def check(state):
    adam = state.opt_state[1][0]  # (clip state, (scale_by_adam state, ...))
    for moment in (adam.mu, adam.nu):
      for p, m in zip(jax.tree.leaves(state.params), jax.tree.leaves(moment)):
        assert m.sharding.is_equivalent_to(p.sharding, p.ndim), (m.sharding, p.sharding)
    assert not adam.mu["embed"][...].sharding.is_fully_replicated
    assert adam.count.sharding.is_fully_replicated

  check(_setup("disa", mesh, adamw=True)[2])
  check(_run("disa", packed_layout(n_devices, MAX_PROMPT + MAX_RESPONSE), steps=1, mesh=mesh,
             adamw=True)[0])  # the update keeps them there


def test_an_update_needs_a_micro_batch():
  graphdef, _, state, _, settings, opt, _ = _setup("disa")
  with pytest.raises(ValueError, match="at least one micro-batch"):
    rl_update.make_train_step(graphdef=graphdef, objective=settings, optimizer=opt,
                              options=NO_DONATE)(state, [])


@pytest.mark.parametrize("method", ["disa", "grpo"])
@pytest.mark.slow
def test_on_policy_old_logp_equals_scoring_pi_old_first(method):
  """One update per batch: taking pi_old from the update's own forward equals scoring it first."""
  graphdef, _, state, _, settings, opt, _ = _setup(method)
  seqs = _seqs(0)
  model = nnx.merge(graphdef, state.params)
  scored = dataclasses.replace(seqs, old_logp=alone_response_logp(model, seqs))
  unscored = dataclasses.replace(seqs, old_logp=np.full_like(seqs.old_logp, np.nan))  # unread
  outs = []
  for on_policy, b in ((False, scored), (True, unscored)):
    step = rl_update.make_train_step(
        graphdef=graphdef, objective=settings, optimizer=opt,
        options=rl_update.StepOptions(donate=False, on_policy_old_logp=on_policy))
    outs.append(step(state, micro_batches(b, packed_layout(4, MAX_PROMPT + MAX_RESPONSE))))
  (s_a, m_a), (s_b, m_b) = outs
  for x, y in zip(jax.tree.leaves(s_a.params), jax.tree.leaves(s_b.params)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-6)
  np.testing.assert_allclose(float(m_a["loss"]), float(m_b["loss"]), rtol=1e-4)  # float32 sums


def test_grpo_without_reference_ignores_ref_logp():
  graphdef, _, state, _, _, opt, _ = _setup("grpo")
  settings = objectives.Grpo(kl_coef=0.0)
  assert not settings.needs_reference and objectives.Grpo(kl_coef=0.1).needs_reference
  seqs = _seqs(0)
  seqs = dataclasses.replace(seqs, ref_logp=np.full_like(seqs.ref_logp, np.nan))
  step = rl_update.make_train_step(graphdef=graphdef, objective=settings, optimizer=opt,
                                   options=NO_DONATE)
  _, metrics = step(state, micro_batches(seqs, packed_layout(4, MAX_PROMPT + MAX_RESPONSE)))
  assert np.isfinite(float(metrics["loss"])) and "kl_ref" not in metrics


def test_head_objective_needs_the_head():
  graphdef, _, _, _, _, opt, _ = _setup("grpo")
  with pytest.raises(ValueError, match="'flowrl' has state"):
    rl_update.make_train_step(graphdef=graphdef, objective=OBJECTIVES["flowrl"], optimizer=opt)


def test_head_dropout_is_seeded_and_joint_clip_bounds_both_gradients():
  """FlowRL's head dropout: reproducible for a seed, different masks for another; the joint clip
  rescales policy and head gradients by one factor (FlowRL's single clip_grad_norm_)."""
  graphdef, head_graphdef, state, _, _, _, _ = _setup("flowrl")
  obj = objectives.FlowRL(beta=2.0, scale="mean", head_dropout=0.5)
  batch = micro_batches(_seqs(0), packed_layout(4, MAX_PROMPT + MAX_RESPONSE))
  sgd = optax.sgd(0.1)
  head_sgd = optax.sgd(0.1)
  def run(seed, joint_clip=0.0):
    step = rl_update.make_train_step(
        graphdef=graphdef, objective=obj, optimizer=sgd, obj_graphdef=head_graphdef,
        obj_optimizer=head_sgd,
        options=rl_update.StepOptions(donate=False, key_seed=seed, joint_clip=joint_clip))
    s0 = rl_update.TrainState(state.step, state.params, sgd.init(state.params), state.obj_params,
                              head_sgd.init(state.obj_params))
    return step(s0, batch)
  (a, ma), (b, _), (c, _) = run(1), run(1), run(2)
  leaves = lambda s: jax.tree.leaves(s.obj_params)
  assert all(np.array_equal(x, y) for x, y in zip(leaves(a), leaves(b)))
  assert not all(np.allclose(x, y) for x, y in zip(leaves(a), leaves(c)))
  clipped, mc = run(1, joint_clip=1e-3)
  norm = float(np.sqrt(ma["grad_norm"] ** 2 + ma["objective_grad_norm"] ** 2))
  assert norm > 1e-2  # the clip is active
  moved = [np.asarray(x) - np.asarray(y) for x, y in
           zip(jax.tree.leaves((clipped.params, clipped.obj_params)),
               jax.tree.leaves((state.params, state.obj_params)))]
  step_norm = float(np.sqrt(sum(float((m ** 2).sum()) for m in moved)))
  np.testing.assert_allclose(step_norm, 0.1 * 1e-3, rtol=1e-3)  # SGD step = lr x clipped norm


def test_runs_of_other_seeds_share_one_compiled_update():
  """The dropout key's seed is an argument of the micro step, not a constant folded into it: the
  FlowRL runs of five seeds compile (and cache) one program, not five."""
  graphdef, head_graphdef, state, _, _, _, _ = _setup("flowrl")
  obj = objectives.FlowRL(beta=2.0, scale="mean", head_dropout=0.5)
  batch = micro_batches(_seqs(0), packed_layout(4, MAX_PROMPT + MAX_RESPONSE))
  sgd = optax.sgd(0.1)
  s0 = rl_update.TrainState(state.step, state.params, sgd.init(state.params), state.obj_params,
                            sgd.init(state.obj_params))
  texts = [rl_update.make_train_step(
      graphdef=graphdef, objective=obj, optimizer=sgd, obj_graphdef=head_graphdef,
      obj_optimizer=sgd, options=rl_update.StepOptions(donate=False, key_seed=seed)
  ).lower(s0, batch[0])["micro"].as_text() for seed in (1, 2)]
  assert texts[0] == texts[1]


def test_lr_schedule_warmup_constant_and_final_decay():
  s = optim.lr_schedule(1.0, warmup_steps=4, decay_frac=0.25, decay_factor=0.1, total_updates=20)
  vals = [float(s(jnp.int32(c))) for c in range(20)]
  assert vals[:5] == pytest.approx([0.0, 0.25, 0.5, 0.75, 1.0])
  assert vals[5:15] == pytest.approx([1.0] * 10) and vals[15:] == pytest.approx([0.1] * 5)
  assert optim.lr_schedule(0.3) == 0.3  # neither asked for: a constant
  with pytest.raises(ValueError, match="decay_frac=0.1 needs the run's total_updates"):
    optim.lr_schedule(1.0, decay_frac=0.1)
  # the optimizer applies it: Adam moves a parameter by ~lr(count) under a constant gradient
  opt = rl_update.make_optimizer(1.0, weight_decay=0.0, grad_clip=0.0, decay_frac=0.5,
                                 decay_factor=0.1, total_updates=4)
  p, state, moves = jnp.zeros(()), None, []
  state = opt.init(p)
  for _ in range(4):
    u, state = opt.update(jnp.ones(()), state, p)
    moves.append(-float(u))
  assert moves == pytest.approx([1.0, 1.0, 0.1, 0.1], rel=1e-4)


@pytest.mark.parametrize("mode", ["separate", "joint"])
def test_flowrl_owns_its_head_state(mode):
  """FlowRL builds its head and optimizer itself (`Objective.init_state`); the update only carries
  them. 'joint': the policy's learning rate, no clip of its own, one clip with the policy's."""
  calls = []
  def make_optimizer(lr, clip=True):
    calls.append((lr, clip))
    return optax.sgd(lr)
  obj = objectives.FlowRL(head_optimizer=mode, head_lr=1e-2, head_layers=2)
  seeds = {"logz_head": 5, "head_dropout": 7}
  st = obj.init_state(32, seeds.__getitem__, make_optimizer, 1e-3)
  assert isinstance(st, objectives.ObjectiveState) and isinstance(st.module, LogZHead)
  assert st.clip_with_policy == (mode == "joint") and st.key_seed == 7 and st.name == "head"
  assert calls == [(1e-3, False)] if mode == "joint" else calls == [(1e-2, True)]
  same = LogZHead(32, 2, rngs=nnx.Rngs(5), init_bias=obj.head_init, dropout_rate=obj.head_dropout)
  for a, b in zip(jax.tree.leaves(nnx.state(st.module, nnx.Param)),
                  jax.tree.leaves(nnx.state(same, nnx.Param))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # Objectives without state have none.
  assert objectives.Grpo().init_state(32, seeds.__getitem__, make_optimizer, 1e-3) is None
  assert not hasattr(objectives.Grpo(), "state_forward")
  # An objective that declares state but cannot build or use it is refused when registered.
  with pytest.raises(TypeError, match="'half_done' declares has_state: it must define init_state "
                                      "and state_forward"):
    @objectives.register
    @dataclasses.dataclass(frozen=True)
    class HalfDone(objectives.Disa):  # pylint: disable=unused-variable
      name: ClassVar[str] = "half_done"
      has_state: ClassVar[bool] = True

      def init_state(self, hidden_size, seed, make_optimizer, policy_lr):
        return None
  assert "half_done" not in objectives.REGISTRY


def test_step_logs_the_pre_clip_norm_the_clipped_share_and_the_mean_residual():
  """Issue 62 item 6: ``grad_norm`` is the global norm of the mini-batch's gradient before the
  clip (computed here independently, one forward/backward of the loss), ``grad_clipped_share`` is 1
  under a tiny clip and 0 under a huge one, and ``tb_residual_mean`` (E[delta]) is the mean over
  valid rows of the loss's own TB residual."""
  model = testing.make_tiny_model(seed=0, **TINY)
  obj = OBJECTIVES["disa"]
  (mb,) = micro_batches(_seqs(0, invalid_rows=2), padded_layout(ROWS))
  graphdef, params = nnx.split(model, nnx.Param)

  def loss(p):
    logp, _ = rl_update.policy_forward(nnx.merge(graphdef, p), mb)
    value, _ = obj.loss(logp, mb)
    return value, logp

  (_, logp), grads = jax.value_and_grad(loss, has_aux=True)(params)
  residual = losses.tb_residual(mb.log_z, logp, mb.ref_logp, mb.signal, mb.response_mask,
                                beta=obj.beta, length_normalize=obj.scale == "mean")
  valid = np.asarray(mb.response_mask).any(-1)
  assert 0 < valid.sum() < len(valid)  # the empty rows must be left out of the mean
  for clip, share in ((1e-6, 1.0), (1e6, 0.0)):
    opt = rl_update.make_optimizer(1e-3, grad_clip=clip)
    graphdef, _, state, _ = rl_update.init_train_state(model, opt)
    step = rl_update.make_train_step(
        graphdef=graphdef, objective=obj, optimizer=opt,
        options=rl_update.StepOptions(donate=False, grad_clip=clip))
    _, metrics = step(state, [mb])
    np.testing.assert_allclose(float(metrics["grad_norm"]), float(optax.global_norm(grads)),
                               rtol=1e-5)
    assert float(metrics["grad_clipped_share"]) == share, clip
    np.testing.assert_allclose(float(metrics["tb_residual_mean"]),
                               float(np.asarray(residual)[valid].mean()), rtol=1e-5, atol=1e-6)


def test_the_trainer_counts_the_clips_at_its_optimizers_clip():
  """`StepOptions.of`: the clipped share is read against the clip the run's optimizer applies
  (the policy's, or the joint one of an objective clipped with the policy)."""
  cfg = config_lib.from_mapping(TrainConfig, {"objective": {"name": "disa"},
                                              "optim": {"grad_clip": 0.5}}, "train")
  assert rl_update.StepOptions.of(cfg, joint=False, key_seed=0).grad_clip == 0.5
  joint = rl_update.StepOptions.of(cfg, joint=True, key_seed=3)
  assert (joint.grad_clip, joint.joint_clip, joint.key_seed) == (0.0, 0.5, 3)
