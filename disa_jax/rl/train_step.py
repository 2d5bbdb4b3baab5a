"""The jitted Stage 3 update: micro-batched gradient accumulation, AdamW, sharded over a Mesh.

One call of the function built by `make_train_step` performs one optimizer update on one
mini-batch, given as a list of `TrainBatch` micro-batches (`TrainSequences.micro_batches`: packed
rows of a fixed shape, so their number varies with the lengths but their shape does not). Each
micro-batch runs one jitted forward/backward that adds its gradient, weighted by the objective's
`normalizer` n_k (its number of valid sequences, or tokens), into a donated accumulator; a second
jitted function divides by sum_k n_k and applies the optimizer. The accumulated gradient equals the
gradient of the objective's loss over the whole mini-batch, and however many micro-batches a
mini-batch has, nothing recompiles. On a mesh the packed rows are sharded over the batch axes and
the per-sequence arrays (``[S, W]`` / ``[S]``) are replicated.

Compiled programs: one micro step per micro-batch shape (one with packing), one optimizer step;
``step.compiled_programs()`` counts them (what `benchmarks/bench_packing.py` checks);
``step.lower(state, micro_batch)`` lowers both without running them (`benchmarks/plan_memory.py`).

An objective with trainable state (``has_state``, `objectives.ObjectiveState`) has its own
parameters and optimizer state (`TrainState` ``obj_params`` / ``obj_opt_state``), never part of the
policy's state: an opaque slot that the update differentiates and steps beside the policy's. The
objective maps it and the policy's final hidden states of the same forward pass to the extra input
of its loss (the objective's ``state_forward``, `Objective`).
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from disa_jax.data.packing import PackedRows
from disa_jax.parallel import distributed
from disa_jax.rl.batch import TrainBatch
from disa_jax.rl.losses import mismatch_metrics
from disa_jax.rl.objectives import Objective
from disa_jax.scoring.logprobs import gather_responses, logprobs_from_hidden, packed_token_logprobs

BATCH_AXES = ("data", "fsdp")


class TrainState(NamedTuple):
  """Everything the update changes. ``obj_*`` are None unless the objective has state."""
  step: jax.Array  # int32 scalar: optimizer updates done
  params: nnx.State  # policy nnx.Param state
  opt_state: Any
  obj_params: nnx.State | None  # the objective's nnx.Param state (`Objective.init_state`)
  obj_opt_state: Any


def lr_schedule(lr: float, *, warmup_steps: int = 0, decay_frac: float = 0.0,
                decay_factor: float = 0.1, total_updates: int = 0) -> optax.Schedule | float:
  """Linear warm-up, then ``lr``, then ``lr * decay_factor`` for the last ``decay_frac`` of the
  ``total_updates`` optimizer updates (a constant ``lr`` when neither is asked for)."""
  if decay_frac > 0 and total_updates < 1:
    raise ValueError(f"decay_frac={decay_frac} needs the run's total_updates, got {total_updates}")
  if warmup_steps <= 0 and decay_frac <= 0:
    return lr
  boundary = int(round((1.0 - decay_frac) * total_updates)) if decay_frac > 0 else None
  def schedule(count):
    value = lr * jnp.minimum(1.0, count / max(warmup_steps, 1)) if warmup_steps > 0 else lr
    if boundary is not None:
      value = jnp.where(count >= boundary, value * decay_factor, value)
    return value
  return schedule


def make_optimizer(lr: float, *, weight_decay: float = 0.01, b1: float = 0.9, b2: float = 0.999,
                   eps: float = 1e-8, grad_clip: float = 1.0, warmup_steps: int = 0,
                   decay_frac: float = 0.0, decay_factor: float = 0.1,
                   total_updates: int = 0) -> optax.GradientTransformation:
  """AdamW on `lr_schedule`, after global-norm clipping (``grad_clip`` <= 0: off)."""
  schedule = lr_schedule(lr, warmup_steps=warmup_steps, decay_frac=decay_frac,
                         decay_factor=decay_factor, total_updates=total_updates)
  adamw = optax.adamw(schedule, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay)
  if grad_clip > 0:
    return optax.chain(optax.clip_by_global_norm(grad_clip), adamw)
  return adamw


def _fold_metrics(acc: dict[str, jax.Array], metrics: dict[str, jax.Array], n: jax.Array
                  ) -> dict[str, jax.Array]:
  """Adds one micro-batch's scalar metrics: running max/min for ``*_max``/``*_min``, else the
  n-weighted sum (divided by sum n in `_final_metrics`)."""
  out = {}
  for k, v in metrics.items():
    if k.endswith("_max"):
      out[k] = jnp.maximum(acc[k], v)
    elif k.endswith("_min"):
      out[k] = jnp.minimum(acc[k], v)
    else:
      out[k] = acc[k] + n * v
  return out


def _metric_init(shapes: dict[str, Any]) -> dict[str, jax.Array]:
  return {k: jnp.full(v.shape, -jnp.inf if k.endswith("_max") else
                      jnp.inf if k.endswith("_min") else 0.0, jnp.float32)
          for k, v in shapes.items()}


def _final_metrics(acc: dict[str, jax.Array], n_total: jax.Array) -> dict[str, jax.Array]:
  total = jnp.maximum(n_total, 1.0)
  return {k: v if k.endswith(("_max", "_min")) else v / total for k, v in acc.items()}


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


def _micro_loss_fn(graphdef: nnx.GraphDef, objective: Objective,
                   obj_graphdef: nnx.GraphDef | None, on_policy_old_logp: bool,
                   mismatch_threshold: float):
  """``(params, obj_params, micro-batch, key) -> (loss, metrics)`` of one micro-batch,
  with the train/inference mismatch (`losses.mismatch_metrics`) where the batch carries the
  engine's log-probs."""

  def micro_loss(params, obj_params, mb: TrainBatch, key: jax.Array):
    model = nnx.merge(graphdef, params)
    logp, hidden = policy_forward(model, mb)
    mismatch = ({} if mb.behaviour_logp is None else
                mismatch_metrics(logp, mb.behaviour_logp, mb.response_mask, mb.on_policy,
                                 threshold=mismatch_threshold))
    if on_policy_old_logp:
      mb = mb.replace(old_logp=jax.lax.stop_gradient(logp))
    state_out = None
    if objective.has_state:
      state_out = objective.state_forward(nnx.merge(obj_graphdef, obj_params), hidden, mb, key)
    loss, metrics = objective.loss(logp, mb, state_out)
    return loss, {**metrics, **mismatch}

  return micro_loss


def _micro_step(grad_fn, objective: Objective, key_seed: int):
  """``(params, obj_params, step, acc, micro-batch, k) -> acc``: adds micro-batch k's
  normalizer-weighted gradients and metrics to the accumulator ``(g, objective g, sum n,
  metrics)``."""

  def micro(params, obj_params, step, acc, mb: TrainBatch, k):
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(key_seed), step), k)
    (loss, metrics), (g, og) = grad_fn(params, obj_params, mb, key)
    n = objective.normalizer(mb)
    g_acc, og_acc, n_acc, m_acc = acc
    return (jax.tree.map(lambda a, b: a + n * b, g_acc, g),
            jax.tree.map(lambda a, b: a + n * b, og_acc, og), n_acc + n,
            _fold_metrics(m_acc, dict(metrics, loss=loss), n))

  return micro


def _finish(state: TrainState, acc) -> tuple[Any, Any, dict[str, jax.Array]]:
  """The accumulator -> (policy gradients, objective gradients or None, metrics)."""
  g_sum, og_sum, n_total, m_acc = acc
  denom = jnp.maximum(n_total, 1.0)
  grads = jax.tree.map(lambda x: x / denom, g_sum)
  obj_grads = jax.tree.map(lambda x: x / denom, og_sum)
  metrics = _final_metrics(m_acc, n_total)
  metrics["grad_norm"] = optax.global_norm(grads)
  metrics["num_sequences"] = n_total
  if state.obj_params is not None:
    metrics["objective_grad_norm"] = optax.global_norm(obj_grads)
  return grads, obj_grads, metrics


def _apply_updates(state: TrainState, grads, obj_grads, metrics, optimizer, obj_optimizer,
                   joint_clip: float) -> tuple[TrainState, dict[str, jax.Array]]:
  """One optimizer step of the policy (and the objective's state), after the optional joint clip."""
  if joint_clip > 0:  # one clip over policy + objective gradients
    norm = optax.global_norm((grads, obj_grads))
    scale = jnp.minimum(1.0, joint_clip / jnp.maximum(norm, 1e-12))
    grads, obj_grads = jax.tree.map(lambda x: x * scale, (grads, obj_grads))
  updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  obj_params, obj_opt_state = state.obj_params, state.obj_opt_state
  if obj_params is not None:
    o_updates, obj_opt_state = obj_optimizer.update(obj_grads, obj_opt_state, obj_params)
    obj_params = optax.apply_updates(obj_params, o_updates)
  return TrainState(state.step + 1, params, opt_state, obj_params, obj_opt_state), metrics


def batch_shardings(mesh: Mesh) -> TrainBatch:
  """A `TrainBatch` of shardings: packed rows over the batch axes, per-sequence arrays replicated."""
  rep = NamedSharding(mesh, PartitionSpec())
  return TrainBatch(rows=NamedSharding(mesh, PartitionSpec(BATCH_AXES)), response_index=rep,
                    response_mask=rep, old_logp=rep, ref_logp=rep, signal=rep, log_z=rep,
                    prompt_slot=rep, behaviour_logp=rep, on_policy=rep)


def place_micro_batch(mb: TrainBatch, mesh: Mesh) -> TrainBatch:
  """A host micro-batch as global arrays on ``mesh`` (every process feeds its own rows)."""
  sh = batch_shardings(mesh)
  return jax.tree.map(lambda s, x: distributed.shard_global_batch(x, s), sh, mb)


def _jit_shardings(mesh: Mesh | None, state_shardings: Any
                   ) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
  """``jax.jit`` sharding arguments of the micro step, the optimizer step and the accumulator's
  initialiser (all empty without a mesh). The accumulator ``(g, objective g, sum n, metrics)`` keeps the
  parameters' shardings; scalars are replicated."""
  if mesh is None:
    return {}, {}, {}
  rep = NamedSharding(mesh, PartitionSpec())
  acc_sh = (state_shardings.params, state_shardings.obj_params, rep, rep)
  kw_micro = dict(in_shardings=(acc_sh[0], acc_sh[1], rep, acc_sh, batch_shardings(mesh), rep),
                  out_shardings=acc_sh)
  kw_finish = dict(in_shardings=(state_shardings, acc_sh), out_shardings=(state_shardings, rep))
  return kw_micro, kw_finish, dict(out_shardings=acc_sh)


class _Update:
  """The update built by `make_train_step`: ``update(state, micro_batches) -> (state, metrics)``.

  Holds the jitted micro step, optimizer step and the accumulator's initialiser (built on the
  first call, once the loss's metric names are known).
  """

  def __init__(self, grad_fn, micro_j, finish_j, kw_init: dict[str, Any]):
    self._grad_fn, self._micro_j, self._finish_j, self._kw_init = grad_fn, micro_j, finish_j, kw_init
    self._init_j = None

  def _init_acc(self, state: TrainState, mb: TrainBatch):
    if self._init_j is None:
      (_, shapes), _ = jax.eval_shape(self._grad_fn, state.params, state.obj_params, mb,
                                      jax.random.key(0))
      shapes = dict(shapes, loss=jax.ShapeDtypeStruct((), jnp.float32))
      zeros = lambda t: jax.tree.map(jnp.zeros_like, t)
      self._init_j = jax.jit(lambda p, op: (zeros(p), zeros(op), jnp.float32(0.0),
                                            _metric_init(shapes)), **self._kw_init)
    return self._init_j

  def __call__(self, state: TrainState, micro_batches: Sequence[TrainBatch]):
    if not micro_batches:
      raise ValueError("an update needs at least one micro-batch, got none")
    acc = self._init_acc(state, micro_batches[0])(state.params, state.obj_params)
    for k, mb in enumerate(micro_batches):
      acc = self._micro_j(state.params, state.obj_params, state.step, acc, mb, jnp.int32(k))
    return self._finish_j(state, acc)

  def lower(self, state: TrainState, mb: TrainBatch) -> dict[str, jax.stages.Lowered]:
    """Lowers the micro step and the optimizer step without running anything.

    ``state`` and ``mb`` may be abstract (`jax.ShapeDtypeStruct` leaves, with shardings on a mesh):
    what `benchmarks/plan_memory.py` compiles to read XLA's memory analysis of a step.

    Returns:
      ``{'micro': the forward/backward + accumulate of one micro-batch, 'finish': the optimizer
      step}`` as `jax.stages.Lowered`.
    """
    acc = jax.eval_shape(self._init_acc(state, mb), state.params, state.obj_params)
    k = jax.ShapeDtypeStruct((), jnp.int32)
    return {"micro": self._micro_j.lower(state.params, state.obj_params, state.step, acc, mb, k),
            "finish": self._finish_j.lower(state, acc)}

  def compiled_programs(self) -> int:
    """Compiled micro and optimizer steps so far (recompilations show up here)."""
    return self._micro_j._cache_size() + self._finish_j._cache_size()  # pylint: disable=protected-access


def make_train_step(graphdef: nnx.GraphDef,
                    objective: Objective,
                    optimizer: optax.GradientTransformation,
                    *,
                    obj_graphdef: nnx.GraphDef | None = None,
                    obj_optimizer: optax.GradientTransformation | None = None,
                    mesh: Mesh | None = None,
                    state_shardings: Any = None,
                    donate: bool = True,
                    on_policy_old_logp: bool = False,
                    joint_clip: float = 0.0,
                    key_seed: int = 0,
                    mismatch_threshold: float = 0.1
                    ) -> Callable[[TrainState, Sequence[TrainBatch]], Any]:
  """Builds the update ``(state, [micro-batch, ...]) -> (state, metrics)`` (see the module
  docstring).

  Args:
    graphdef: the policy's graph (from ``nnx.split(model, nnx.Param, ...)``).
    objective: what to optimise (`disa_jax.rl.objectives`).
    optimizer: the policy's optax transformation (see `make_optimizer`).
    obj_graphdef, obj_optimizer: the graph and optimizer of the objective's state (objectives with
      ``has_state``, `objectives.ObjectiveState`).
    mesh: when given, every micro-batch is placed by `batch_shardings` and the state keeps
      ``state_shardings``.
    state_shardings: shardings of `TrainState` (e.g. ``jax.tree.map(lambda x: x.sharding, state)``).
    donate: donate the input state buffers.
    on_policy_old_logp: the batch was sampled from the current parameters and this is its only
      update (one mini-batch): pi_old is the policy itself, so ``old_logp`` is taken as the
      detached log-probs of this forward pass and ``batch.old_logp`` is ignored (saves the
      separate scoring pass; what TRL does with one iteration per batch).
    joint_clip: > 0: one global-norm clip at this value over the policy's and the objective's
      gradients together, before both optimizers (which then must not clip themselves;
      `ObjectiveState.clip_with_policy`).
    key_seed: seeds the key given to the objective's ``state_forward``, folded with the update
      count and the micro-batch index, so a resumed run draws the same keys
      (`ObjectiveState.key_seed`).
    mismatch_threshold: the nats of ``mismatch/frac_over`` (`losses.mismatch_metrics`).

  Returns:
    The update. Metrics: the loss's metrics combined over micro-batches (normalizer-weighted
    means, max of ``*_max``, min of ``*_min``), plus ``loss``, ``grad_norm`` (before clipping),
    ``num_sequences`` (the summed normalizer), with objective state ``objective_grad_norm``, and with
    the engine's
    log-probs in the batch ``mismatch/*``.
  """
  if objective.has_state and (obj_graphdef is None or obj_optimizer is None):
    raise ValueError(f"objective {objective.name!r} has state: it needs obj_graphdef and "
                     "obj_optimizer, got None")
  grad_fn = jax.value_and_grad(
      _micro_loss_fn(graphdef, objective, obj_graphdef, on_policy_old_logp, mismatch_threshold),
      argnums=(0, 1), has_aux=True)
  micro = _micro_step(grad_fn, objective, key_seed)

  def finish(state: TrainState, acc):
    grads, obj_grads, metrics = _finish(state, acc)
    return _apply_updates(state, grads, obj_grads, metrics, optimizer, obj_optimizer,
                          joint_clip)

  donated = (0,) if donate else ()  # (the accumulator's buffers match no output)
  kw_micro, kw_finish, kw_init = _jit_shardings(mesh, state_shardings)
  micro_j = jax.jit(micro, donate_argnums=(3,), **kw_micro)
  finish_j = jax.jit(finish, donate_argnums=donated, **kw_finish)
  return _Update(grad_fn, micro_j, finish_j, kw_init)


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


def make_scoring_fn(graphdef: nnx.GraphDef) -> Callable[[nnx.State, PackedRows], jax.Array]:
  """Jitted ``(params, packed rows [R, L]) -> [R, L]`` token log-probs (`packed_token_logprobs`).

  Used for the reference log-probs (frozen reference params) and for recomputing old log-probs
  with the policy before the updates. No gradient is taken.
  """

  @jax.jit
  def score(params, rows):
    return jax.lax.stop_gradient(packed_token_logprobs(nnx.merge(graphdef, params), rows))

  return score
