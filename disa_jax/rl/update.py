"""Update: the last part of a Stage 3 step. The jitted update of the policy, then the weight push.

`PolicyUpdater` owns the trained state (the policy's parameters, its AdamW state and, for an
objective with state, its parameters and optimizer, `objectives.ObjectiveState`, carried as an
opaque slot) and the jitted update built by `make_train_step`. `pack(step, batch)` lays the
step's rollouts out once, right after collection (`disa_jax.rl.batch.PackedRollout`): shuffled
with the step's seed, split into ``rollout.num_minibatches`` equal mini-batches of sequences, each
packed into fixed-shape micro-batches (`RolloutConfig.layout`). The scorer writes its log-probs
into that layout's slots, and `update(scored)` runs one optimizer update per mini-batch on its
slice of the same micro-batches (`ScoredBatch.train_batches`). Then the new policy weights (a
flat push, never the objective's state) go to this host's engine (`EngineLink`): at once with
synchronous rollouts (`push`, a collective: `disa_jax.rollout.multihost.push_weights`), or, with
asynchronous ones (``rollout.max_staleness`` = k > 0), as an owned host copy
(`multihost.host_weights`) handed to the `RolloutPipeline`, which queues the push on its rollout
thread between the engine's generate calls and before the sampling of step done + k
(`queue_push`, `disa_jax.rl.async_rollout`).

The jitted update. One call of the function built by `make_train_step` performs one optimizer
update on one mini-batch, given as a list of `TrainBatch` micro-batches (packed rows of a fixed
shape, so their number varies with the lengths but their shape does not). Each micro-batch runs
one jitted forward/backward that adds its gradient, weighted by the objective's `normalizer` n_k
(its number of valid sequences, or tokens), into a donated accumulator; a second jitted function
divides by sum_k n_k and applies the optimizer. The accumulated gradient equals the gradient of the
objective's loss over the whole mini-batch, and however many micro-batches a mini-batch has,
nothing recompiles. On a mesh the packed rows are sharded over the batch axes and the per-sequence
arrays (``[S, W]`` / ``[S]``) are replicated.

The accumulation is `disa_jax.optim.AccumulatingStep` (weights w_k = c_k = n_k), the optimizer
`disa_jax.optim.make_optimizer` (re-exported here). Compiled programs: one micro step per
micro-batch shape (one with packing), one optimizer step; ``step.compiled_programs()`` counts them
(what `benchmarks/bench_packing.py` checks); ``step.lower(state, micro_batch)`` lowers both
without running them (`benchmarks/plan_memory.py`).

An objective with trainable state (``has_state``, `objectives.ObjectiveState`) has its own
parameters and optimizer state (`TrainState` ``obj_params`` / ``obj_opt_state``), never part of the
policy's state: an opaque slot that the update differentiates and steps beside the policy's. The
objective maps it and the policy's final hidden states of the same forward pass to the extra input
of its loss (the objective's ``state_forward``, `Objective`).
"""
from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from disa_jax import models
from disa_jax import parallel
from disa_jax.data import packing as packing_lib
from disa_jax.data.packing import sequence_lengths
from disa_jax.optim import AccumulatingStep, make_optimizer
from disa_jax.parallel import distributed
from disa_jax.rl import seeds
from disa_jax.rl.async_rollout import RolloutPipeline
from disa_jax.rl.batch import (BATCH_AXES, PackedRollout, RolloutBatch, ScoredBatch, TrainBatch,
                               pack_rollout)
from disa_jax.rl.config import OptimConfig, TrainConfig
from disa_jax.rl.inputs import EngineLink, StepModels
from disa_jax.rl.losses import mismatch_metrics
from disa_jax.rl.objectives import Objective
from disa_jax.rollout import multihost
from disa_jax.scoring.logprobs import gather_responses, logprobs_from_hidden


# -- the jitted update -----------------------------------------------------------------------------


class TrainState(NamedTuple):
  """Everything the update changes. ``obj_*`` are None unless the objective has state."""
  step: jax.Array  # int32 scalar: optimizer updates done
  params: nnx.State  # policy nnx.Param state
  opt_state: Any
  obj_params: nnx.State | None  # the objective's nnx.Param state (`Objective.init_state`)
  obj_opt_state: Any


def policy_forward(model: nnx.Module, mb: TrainBatch) -> tuple[jax.Array, jax.Array]:
  """One micro-batch through the policy.

  Returns:
    (``[S, W]`` log-probs of each slot's response tokens, ``[R, L, D]`` final hidden states).
  """
  rows = mb.rows
  hidden = model.hidden_states(rows.input_ids, segment_ids=rows.segment_ids,
                               positions=rows.positions, branch_ids=rows.branch_ids)
  token_lp = logprobs_from_hidden(hidden, model.lm_head_kernel(), rows.input_ids, None,
                                  segment_ids=rows.segment_ids,
                                  branch_ids=rows.branch_ids)  # [R, L]
  return gather_responses(token_lp, mb.response_index, mb.response_mask), hidden


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepOptions:
  """How the jitted update treats its batch and gradients (`make_train_step`; `PolicyUpdater`
  fills it from the run's config, `StepOptions.of`).

  Attributes:
    on_policy_old_logp: the batch was sampled from the current parameters and this is its only
      update (one mini-batch): pi_old is the policy itself, so ``old_logp`` is taken as the
      detached log-probs of this forward pass and ``batch.old_logp`` is ignored (saves the
      separate scoring pass; what TRL does with one iteration per batch).
    grad_clip: the global-norm clip the policy's optimizer applies (`make_optimizer`'s
      ``grad_clip``; <= 0: none): an update counts as clipped (``grad_clipped_share``) when its
      gradient's norm exceeds it. Ignored with ``joint_clip``.
    joint_clip: > 0: one global-norm clip at this value over the policy's and the objective's
      gradients together, before both optimizers (which then must not clip themselves;
      `ObjectiveState.clip_with_policy`).
    key_seed: seeds the key given to the objective's ``state_forward``, folded with the update
      count and the micro-batch index, so a resumed run draws the same keys
      (`ObjectiveState.key_seed`).
    mismatch_threshold: the nats of ``mismatch/frac_over`` (`losses.mismatch_metrics`).
    donate: donate the input state buffers.
  """
  on_policy_old_logp: bool = False
  grad_clip: float = 0.0
  joint_clip: float = 0.0
  key_seed: int = 0
  mismatch_threshold: float = 0.1
  donate: bool = True

  @classmethod
  def of(cls, cfg: TrainConfig, *, joint: bool, key_seed: int) -> "StepOptions":
    """The options of a run's update: ``joint``: the objective's state is clipped with the
    policy (`ObjectiveState.clip_with_policy`) at ``optim.grad_clip``."""
    clip = cfg.optim.grad_clip
    return cls(on_policy_old_logp=cfg.old_logp_in_update, grad_clip=0.0 if joint else clip,
               joint_clip=clip if joint else 0.0, key_seed=key_seed,
               mismatch_threshold=cfg.rollout.mismatch_threshold)


def _micro_loss_fn(graphdef: nnx.GraphDef, objective: Objective,
                   obj_graphdef: nnx.GraphDef | None, options: StepOptions):
  """The `optim.AccumulatingStep` loss of one micro-batch: ``((params, obj_params), base key, mb,
  step, k) -> (loss, (n, n, metrics))`` with n the objective's `normalizer`, and the
  train/inference mismatch (`losses.mismatch_metrics`) where the batch carries the engine's
  log-probs. The objective's state gets the key of (``options.key_seed``, step, k): ``const`` is
  ``jax.random.key(options.key_seed)`` (`make_train_step`), an argument of the program."""
  on_policy_old_logp = options.on_policy_old_logp

  def micro_loss(params, base_key, mb: TrainBatch, step, k):
    params, obj_params = params
    model = nnx.merge(graphdef, params)
    logp, hidden = policy_forward(model, mb)
    mismatch = ({} if mb.behaviour_logp is None else
                mismatch_metrics(logp, mb.behaviour_logp, mb.response_mask, mb.on_policy,
                                 threshold=options.mismatch_threshold))
    if on_policy_old_logp:
      mb = mb.replace(old_logp=jax.lax.stop_gradient(logp))
    state_out = None
    if objective.has_state:
      key = jax.random.fold_in(jax.random.fold_in(base_key, step), k)
      state_out = objective.state_forward(nnx.merge(obj_graphdef, obj_params), hidden, mb, key)
    loss, metrics = objective.loss(logp, mb, state_out)
    n = objective.normalizer(mb)
    return loss, (n, n, {**metrics, **mismatch})

  return micro_loss


def _apply_fn(optimizer, obj_optimizer, options: StepOptions):
  """The `optim.AccumulatingStep` optimizer step: ``(state, (grads, objective grads), metrics,
  sum n) -> (state, metrics)``, after the optional joint clip; adds ``grad_norm`` (the policy's,
  before any clip), ``grad_clipped_share`` (1 when this update's gradient is clipped: its norm,
  joint with the objective's under a joint clip, above the clip; 0 otherwise or without a clip),
  ``num_sequences`` and with objective state ``objective_grad_norm``."""
  joint_clip = options.joint_clip

  def apply(state: TrainState, grads, metrics, n_total):
    grads, obj_grads = grads
    norm = optax.global_norm(grads)
    metrics = dict(metrics, grad_norm=norm, num_sequences=n_total)
    if state.obj_params is not None:
      metrics["objective_grad_norm"] = optax.global_norm(obj_grads)
    clip = options.grad_clip
    if joint_clip > 0:  # one clip over policy + objective gradients
      norm, clip = optax.global_norm((grads, obj_grads)), joint_clip
      scale = jnp.minimum(1.0, joint_clip / jnp.maximum(norm, 1e-12))
      grads, obj_grads = jax.tree.map(lambda x: x * scale, (grads, obj_grads))
    metrics["grad_clipped_share"] = jnp.asarray(clip > 0, jnp.float32) * (norm > clip)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    obj_params, obj_opt_state = state.obj_params, state.obj_opt_state
    if obj_params is not None:
      o_updates, obj_opt_state = obj_optimizer.update(obj_grads, obj_opt_state, obj_params)
      obj_params = optax.apply_updates(obj_params, o_updates)
    return TrainState(state.step + 1, params, opt_state, obj_params, obj_opt_state), metrics

  return apply


def batch_shardings(mesh: Mesh) -> TrainBatch:
  """A `TrainBatch` of shardings: packed rows over the batch axes, per-sequence arrays
  replicated."""
  rep = NamedSharding(mesh, PartitionSpec())
  return TrainBatch(rows=NamedSharding(mesh, PartitionSpec(BATCH_AXES)), response_index=rep,
                    response_mask=rep, old_logp=rep, ref_logp=rep, signal=rep, log_z=rep,
                    prompt_slot=rep, behaviour_logp=rep, on_policy=rep)


def place_micro_batches(micro: Sequence[TrainBatch], mesh: Mesh) -> list[TrainBatch]:
  """Host micro-batches as global arrays on ``mesh`` (every process feeds its own rows), placed
  together: in one process one batched transfer for all of them (a placement's fixed cost paid
  once per update, not once per micro-batch); on one device the host arrays, which the micro step
  transfers itself (`distributed.feed`)."""
  return distributed.feed(list(micro), [batch_shardings(mesh)] * len(micro))


def _jit_shardings(mesh: Mesh | None, state_shardings: Any
                   ) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
  """``jax.jit`` sharding arguments of the micro step, the optimizer step and the accumulator's
  initialiser (all empty without a mesh). The accumulator ``((g, objective g), sum n, metrics)``
  keeps the parameters' shardings; scalars are replicated."""
  if mesh is None:
    return {}, {}, {}
  rep = NamedSharding(mesh, PartitionSpec())
  params_sh = (state_shardings.params, state_shardings.obj_params)
  acc_sh = (params_sh, rep, rep)
  kw_micro = dict(in_shardings=(params_sh, rep, rep, acc_sh, batch_shardings(mesh), rep),
                  out_shardings=acc_sh)
  kw_finish = dict(in_shardings=(state_shardings, acc_sh), out_shardings=(state_shardings, rep))
  return kw_micro, kw_finish, dict(out_shardings=acc_sh)


def make_train_step(*,
                    graphdef: nnx.GraphDef,
                    objective: Objective,
                    optimizer: optax.GradientTransformation,
                    options: StepOptions = StepOptions(),
                    obj_graphdef: nnx.GraphDef | None = None,
                    obj_optimizer: optax.GradientTransformation | None = None,
                    mesh: Mesh | None = None,
                    state_shardings: Any = None) -> AccumulatingStep:
  """Builds the update ``(state, [micro-batch, ...]) -> (state, metrics)`` (see the module
  docstring).

  Args:
    graphdef: the policy's graph (from ``nnx.split(model, nnx.Param, ...)``).
    objective: what to optimise (`disa_jax.rl.objectives`).
    optimizer: the policy's optax transformation (see `make_optimizer`).
    options: how the update treats its batch and gradients (`StepOptions`).
    obj_graphdef, obj_optimizer: the graph and optimizer of the objective's state (objectives with
      ``has_state``, `objectives.ObjectiveState`).
    mesh: when given, every micro-batch is placed by `batch_shardings` and the state keeps
      ``state_shardings``.
    state_shardings: shardings of `TrainState` (e.g. ``jax.tree.map(lambda x: x.sharding, state)``).

  Returns:
    The update. Metrics: the loss's metrics combined over micro-batches (normalizer-weighted
    means, max of ``*_max``, min of ``*_min``), plus ``loss``, ``grad_norm`` (before clipping),
    ``grad_clipped_share``, ``num_sequences`` (the summed normalizer), with objective state
    ``objective_grad_norm``, and with the engine's log-probs in the batch ``mismatch/*``.
  """
  if objective.has_state and (obj_graphdef is None or obj_optimizer is None):
    raise ValueError(f"objective {objective.name!r} has state: it needs obj_graphdef and "
                     "obj_optimizer, got None")
  loss_fn = _micro_loss_fn(graphdef, objective, obj_graphdef, options)
  kw_micro, kw_finish, kw_init = _jit_shardings(mesh, state_shardings)
  return AccumulatingStep(loss_fn, _apply_fn(optimizer, obj_optimizer, options),
                          lambda state: ((state.params, state.obj_params), state.step),
                          donate=options.donate, micro_kw=kw_micro, finish_kw=kw_finish,
                          init_kw=kw_init, const=(jax.random.key(options.key_seed)
                                                  if objective.has_state else None))


def opt_state_shardings(optimizer: optax.GradientTransformation, params: Any, mesh: Mesh) -> Any:
  """Shardings of ``optimizer.init(params)`` on ``mesh``: every parameter-shaped part of the state
  (AdamW's moments) takes its parameter's sharding, everything else (step counts) is replicated.

  ``params`` may be concrete or abstract (`jax.ShapeDtypeStruct` leaves with shardings); a
  parameter not spread over the whole mesh gets replicated moments. Without these shardings
  ``jax.jit(optimizer.init)`` leaves the zeros' placement to the compiler, which replicates them:
  two f32 copies of the whole model on every device.
  """
  rep = NamedSharding(mesh, PartitionSpec())
  n = mesh.devices.size
  shapes = jax.eval_shape(optimizer.init, params)
  param_sh = jax.tree.map(
      lambda x: x.sharding if x.sharding is not None and len(x.sharding.device_set) == n else rep,
      params)
  return optax.tree_map_params(optimizer, lambda _, sh: sh, shapes, param_sh,
                               transform_non_params=lambda _: rep)


def init_train_state(model: nnx.Module,
                     optimizer: optax.GradientTransformation,
                     obj_module: nnx.Module | None = None,
                     obj_optimizer: optax.GradientTransformation | None = None,
                     *,
                     mesh: Mesh | None = None,
                     step: int = 0) -> tuple[nnx.GraphDef, nnx.GraphDef | None, TrainState, Any]:
  """Splits the policy (and the objective's state, `objectives.ObjectiveState` ``module``) into
  graph + params and initialises optimizer states.

  Policy parameters keep their current placement (shard the model first with
  `disa_jax.parallel.shard_model`); with a ``mesh`` the optimizer moments get the same shardings
  (`opt_state_shardings`), and the step counter and the (small) objective state are replicated over
  it.

  Returns:
    (policy graphdef, objective graphdef or None, TrainState, shardings of the TrainState).
  """
  graphdef, params = nnx.split(model, nnx.Param)
  put = (lambda x: x) if mesh is None else (
      lambda x: jax.device_put(x, NamedSharding(mesh, PartitionSpec())))
  obj_graphdef = obj_params = obj_opt = None
  if obj_module is not None:
    if obj_optimizer is None:
      raise ValueError("the objective's state needs obj_optimizer, got None")
    obj_graphdef, obj_params = nnx.split(obj_module, nnx.Param)
    obj_params = jax.tree.map(put, obj_params)
    obj_opt = jax.jit(obj_optimizer.init)(obj_params)
  opt_kw = {} if mesh is None else dict(
      out_shardings=opt_state_shardings(optimizer, params, mesh))
  opt_state = jax.jit(optimizer.init, **opt_kw)(params)
  state = TrainState(jnp.asarray(step, jnp.int32), params, opt_state, obj_params, obj_opt)
  if mesh is not None:
    # Leaves created without a sharded input (step, optimizer counts, the objective's state) are
    # replicated.
    n = mesh.devices.size
    state = jax.tree.map(lambda x: x if len(x.sharding.device_set) == n else put(x), state)
  shardings = jax.tree.map(lambda x: x.sharding, state)
  return graphdef, obj_graphdef, state, shardings


# -- a step's update and weight push ---------------------------------------------------------------


def _combine(collected: list[dict[str, float]]) -> dict[str, float]:
  """Per-mini-batch metrics -> one dict: max of ``*_max``, min of ``*_min``, mean otherwise.

  ``mismatch/*`` come from the first mini-batch alone: only its forward runs the weights the engine
  was given (the later ones run weights this step has already updated).
  """
  out = {}
  for k in collected[0]:
    vals = [c[k] for c in (collected[:1] if k.startswith("mismatch/") else collected)]
    out[k] = max(vals) if k.endswith("_max") else min(vals) if k.endswith("_min") else float(
        np.mean(vals))
  return out


def optim_kwargs(oc: OptimConfig, updates: int) -> dict[str, Any]:
  """`make_optimizer` arguments besides the learning rate, from the ``optim`` section
  and the run's ``updates`` (`TrainConfig.total_updates`)."""
  return dict(weight_decay=oc.weight_decay, b1=oc.b1, b2=oc.b2, eps=oc.eps,
              grad_clip=oc.grad_clip, warmup_steps=oc.warmup_steps,
              decay_frac=oc.decay_frac, decay_factor=oc.decay_factor, total_updates=updates)


def optimizer_kwargs(cfg: TrainConfig) -> dict[str, Any]:
  """`disa_jax.optim.make_optimizer` arguments besides the learning rate, from ``cfg.optim`` (the
  policy's AdamW; `PolicyUpdater` zeroes ``grad_clip`` when a joint clip replaces it,
  `objectives.ObjectiveState.clip_with_policy`)."""
  return optim_kwargs(cfg.optim, cfg.total_updates)


class PolicyUpdater:
  """The trained state, its update and the push of its weights (see the module docstring).

  Args:
    cfg: the run's config: its objective (loss, state), ``optim``, ``rollout`` (mini-batches,
      micro-batch layout, ``mismatch_threshold``) and ``seed`` (the objective's state and each
      step's shuffle, `disa_jax.rl.seeds`); the learning-rate schedule runs over
      ``cfg.total_updates``, and pi_old comes from the update's own forward when
      ``cfg.old_logp_in_update``.
    step_models: the policy (already sharded on ``step_models.mesh``), the mesh and ``pad_to``
      (without packing, rows are padded to a multiple of it).
    pad_id: padding token id of the packed rows.
    link: this host's engine and the weight push into it (its dtype and bucket size).
  """

  def __init__(self, cfg: TrainConfig, step_models: StepModels, pad_id: int, link: EngineLink):
    total_updates = cfg.total_updates
    if total_updates < 1:
      raise ValueError(f"PolicyUpdater total_updates must be >= 1, got {total_updates}")
    policy, mesh = step_models.policy, step_models.mesh
    rollout, seed = cfg.rollout, cfg.seed
    self.rollout, self.seed, self.policy, self.mesh = rollout, seed, policy, mesh
    self.pad_id, self.pad_to, self.link = pad_id, step_models.pad_to, link
    obj, oc = cfg.objective, cfg.optim
    opt_kwargs = optim_kwargs(oc, total_updates)

    def make_opt(lr: float, clip: bool = True):
      return make_optimizer(lr, **{**opt_kwargs, "grad_clip": oc.grad_clip if clip else 0.0})

    # The objective's trainable state (None without): an opaque slot beside the policy's.
    obj_state = obj.init_state(policy.config.hidden_size,
                               lambda name: seeds.objective_seed(seed, name), make_opt, oc.lr)
    joint = obj_state is not None and obj_state.clip_with_policy
    # A joint clip: one clip over policy + objective gradients in the step, none in the optimizers.
    optimizer = make_opt(oc.lr, clip=not joint)
    obj_module, obj_opt, key_seed, self._obj_name = (
        (None, None, 0, None) if obj_state is None else
        (obj_state.module, obj_state.optimizer, obj_state.key_seed, obj_state.name))
    self.graphdef, obj_graphdef, self.state, shardings = init_train_state(
        policy, optimizer, obj_module, obj_opt, mesh=mesh)
    self._step = make_train_step(graphdef=self.graphdef, objective=obj, optimizer=optimizer,
                                 options=StepOptions.of(cfg, joint=joint, key_seed=key_seed),
                                 obj_graphdef=obj_graphdef, obj_optimizer=obj_opt, mesh=mesh,
                                 state_shardings=shardings)

  def pack(self, step: int, batch: RolloutBatch) -> PackedRollout:
    """The step's packed training layout, packed once right after collection: the ``[B]``
    sequences shuffled with the step's seed, split into ``num_minibatches`` equal mini-batches,
    each packed into fixed-shape micro-batches (`RolloutConfig.layout`). The scorer fills its
    slots; `update` trains on it."""
    rc, n = self.rollout, batch.num_rows
    layout = rc.layout(sequence_lengths(batch.prompts, batch.response_ids), self.pad_to,
                       parallel.batch_shards(self.mesh))
    order = seeds.minibatch_rng(self.seed, step).permutation(n)
    size = n // rc.num_minibatches
    return pack_rollout(batch, layout, [order[m * size:(m + 1) * size]
                                        for m in range(rc.num_minibatches)], pad_id=self.pad_id)

  def update(self, scored: ScoredBatch) -> dict[str, float]:
    """One optimizer update per mini-batch of ``scored`` (`pack`).

    Returns:
      The mini-batches' metrics combined, plus ``packing/micro_batches`` (per update) and
      ``packing/efficiency`` (non-padding tokens / computed tokens; a shared prompt counts once
      per unit, `disa_jax.data.packing.PackedBatch.num_real_tokens`).
    """
    packed = scored.packed
    collected = []
    for m in range(len(packed.minibatches)):
      micro = scored.train_batches(m)
      self.state, metrics = self._step(self.state,
                                       place_micro_batches(micro, self.mesh))
      collected.append(metrics)
    # One host transfer for all mini-batches' metrics.
    out = _combine([{k: float(v) for k, v in m.items()}
                    for m in distributed.replicate_to_hosts(collected)])
    micro = packed.micro
    out.update({"packing/micro_batches": len(micro) / len(packed.minibatches),
                "packing/efficiency": packing_lib.efficiency(micro)})
    return out

  def current_policy(self) -> models.Transformer:
    """The policy `Transformer` holding the trained parameters (updated in place)."""
    nnx.update(self.policy, self.state.params)
    return self.policy

  def push(self) -> None:
    """Collective: the engine gets the current policy (never the objective's state) before this
    returns (start, resume, synchronous rollouts): a flat push (`multihost.push_weights`, host
    copies on host leaders only)."""
    link = self.link
    multihost.push_weights(self.current_policy(), link.engine, dtype=link.push_dtype,
                           bucket_bytes=link.push_bucket_bytes)

  def queue_push(self, pipeline: RolloutPipeline, done: int) -> None:
    """Collective: after ``done`` updates, the weights of version ``done`` go to ``pipeline`` (an
    owned host copy, `multihost.host_weights`), which pushes them on its rollout thread before
    its sampling of step done + k (asynchronous rollouts)."""
    link = self.link
    weights = multihost.host_weights(self.current_policy(), link.push_dtype,
                                     link.push_bucket_bytes)  # collective
    pipeline.advance(done, weights if link.engine is not None else None)

  # -- checkpoints -------------------------------------------------------------------------------

  def checkpoint_state(self) -> dict[str, Any]:
    """The trained state as a checkpoint's tree; the objective's state, if any, under
    ``<name>_params`` / ``<name>_opt_state`` (`objectives.ObjectiveState.name`)."""
    s = self.state
    out = {"step": s.step, "params": nnx.to_pure_dict(s.params), "opt_state": s.opt_state}
    if s.obj_params is not None:
      out[f"{self._obj_name}_params"] = nnx.to_pure_dict(s.obj_params)
      out[f"{self._obj_name}_opt_state"] = s.obj_opt_state
    return out

  def load_checkpoint_state(self, restored: dict[str, Any]) -> None:
    params = self.state.params
    nnx.replace_by_pure_dict(params, restored["params"])
    obj_params, obj_opt_state = self.state.obj_params, None
    if obj_params is not None:
      nnx.replace_by_pure_dict(obj_params, restored[f"{self._obj_name}_params"])
      obj_opt_state = restored[f"{self._obj_name}_opt_state"]
    self.state = TrainState(restored["step"], params, restored["opt_state"], obj_params,
                            obj_opt_state)

  def param_shapes(self) -> dict[str, list[int]]:
    """``{parameter path: shape}`` of the trained state (compared before a resume)."""
    flat = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(self.state.params))[0]
    return {jax.tree_util.keystr(p): list(np.shape(v)) for p, v in flat}
