"""The jitted Stage 3 update: micro-batched gradient accumulation, AdamW, sharded over a Mesh.

One call of the function built by `make_train_step` performs one optimizer update on one
mini-batch. The mini-batch arrives as a `TrainBatch` already split into micro-batches: every array
has a leading micro-batch axis ``[K, b, ...]`` (K micro-batches of b rows), sharded over the mesh's
batch axes on ``b``. The micro-batches run in a `lax.scan`; micro-batch k's gradient is weighted
by the objective's `normalizer` n_k (its number of valid rows), so that the accumulated gradient
equals the gradient of the objective's loss over the whole mini-batch.

The FlowRL log Z head (objectives with ``needs_logz_head``) is a separate module with its own
parameters and optimizer state (`TrainState` ``head_params`` / ``head_opt_state``), never part of
the policy's state; its input is the masked mean of the policy's final hidden states over the
prompt tokens of the same forward pass.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from disa_jax.rl.batch import TrainBatch
from disa_jax.rl.logz_head import masked_mean_embedding
from disa_jax.rl.objectives import Objective
from disa_jax.scoring.logprobs import logprobs_from_hidden, token_logprobs

BATCH_AXES = ("data", "fsdp")


class TrainState(NamedTuple):
  """Everything the update changes. ``head_*`` are None unless the objective has a log Z head."""
  step: jax.Array  # int32 scalar: optimizer updates done
  params: nnx.State  # policy nnx.Param state
  opt_state: Any
  head_params: nnx.State | None
  head_opt_state: Any


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


def _combine_metrics(stacked: dict[str, jax.Array], weights: jax.Array) -> dict[str, jax.Array]:
  """Micro-batch metrics ``[K]`` -> scalars: max/min for ``*_max``/``*_min``, else weighted mean."""
  out = {}
  total = jnp.maximum(weights.sum(), 1.0)
  for k, v in stacked.items():
    if k.endswith("_max"):
      out[k] = v.max()
    elif k.endswith("_min"):
      out[k] = v.min()
    else:
      out[k] = (v * weights).sum() / total
  return out


def policy_forward(model: nnx.Module, mb: TrainBatch) -> tuple[jax.Array, jax.Array]:
  """(``[b, T]`` token log-probs, ``[b, T, D]`` final hidden states) of one micro-batch."""
  hidden = model.hidden_states(mb.input_ids, attention_mask=mb.attention_mask)
  logp = logprobs_from_hidden(hidden, model.lm_head_kernel(), mb.input_ids, mb.attention_mask)
  return logp, hidden


def _micro_loss_fn(graphdef: nnx.GraphDef, objective: Objective,
                   head_graphdef: nnx.GraphDef | None, on_policy_old_logp: bool):
  """``(params, head_params, micro-batch, dropout key) -> (loss, metrics)`` of one micro-batch."""

  def micro_loss(params, head_params, mb: TrainBatch, key: jax.Array):
    model = nnx.merge(graphdef, params)
    logp, hidden = policy_forward(model, mb)
    if on_policy_old_logp:
      mb = mb.replace(old_logp=jax.lax.stop_gradient(logp))
    head_log_z = None
    if objective.needs_logz_head:
      emb = masked_mean_embedding(hidden, mb.prompt_mask, pooling=objective.head_pooling)  # [b, D]
      head_log_z = nnx.merge(head_graphdef, head_params)(
          emb, dropout_key=key if objective.head_dropout > 0 else None)  # [b]
    return objective.loss(logp, mb, head_log_z)

  return micro_loss


def _accumulate(grad_fn, objective: Objective, state: TrainState, batch: TrainBatch,
                dropout_seed: int):
  """Normalizer-weighted mean of the micro-batch gradients of ``batch`` ``[K, b, ...]``.

  Returns:
    (policy gradients, head gradients or None, metrics combined over micro-batches).
  """
  zeros = lambda t: jax.tree.map(jnp.zeros_like, t)
  init = (zeros(state.params), zeros(state.head_params), jnp.float32(0.0))
  step_key = jax.random.fold_in(jax.random.key(dropout_seed), state.step)
  keys = jax.random.split(step_key, batch.input_ids.shape[0])  # one per micro-batch

  def body(carry, xs):
    mb, key = xs
    g_acc, hg_acc, n_acc = carry
    (loss, metrics), (g, hg) = grad_fn(state.params, state.head_params, mb, key)
    n = objective.normalizer(mb)
    g_acc = jax.tree.map(lambda a, b: a + n * b, g_acc, g)
    hg_acc = jax.tree.map(lambda a, b: a + n * b, hg_acc, hg)
    return (g_acc, hg_acc, n_acc + n), (dict(metrics, loss=loss), n)

  (g_sum, hg_sum, n_total), (stacked, counts) = jax.lax.scan(body, init, (batch, keys))
  denom = jnp.maximum(n_total, 1.0)
  grads = jax.tree.map(lambda x: x / denom, g_sum)
  head_grads = jax.tree.map(lambda x: x / denom, hg_sum)
  metrics = _combine_metrics(stacked, counts)
  metrics["grad_norm"] = optax.global_norm(grads)
  metrics["num_sequences"] = n_total
  if state.head_params is not None:
    metrics["head_grad_norm"] = optax.global_norm(head_grads)
  return grads, head_grads, metrics


def _apply_updates(state: TrainState, grads, head_grads, metrics, optimizer, head_optimizer,
                   joint_clip: float) -> tuple[TrainState, dict[str, jax.Array]]:
  """One optimizer step of the policy (and head), after the optional joint clip."""
  if joint_clip > 0:  # one clip over policy + head gradients (FlowRL's code)
    norm = optax.global_norm((grads, head_grads))
    scale = jnp.minimum(1.0, joint_clip / jnp.maximum(norm, 1e-12))
    grads, head_grads = jax.tree.map(lambda x: x * scale, (grads, head_grads))
  updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  head_params, head_opt_state = state.head_params, state.head_opt_state
  if head_params is not None:
    h_updates, head_opt_state = head_optimizer.update(head_grads, head_opt_state, head_params)
    head_params = optax.apply_updates(head_params, h_updates)
  return TrainState(state.step + 1, params, opt_state, head_params, head_opt_state), metrics


def make_train_step(graphdef: nnx.GraphDef,
                    objective: Objective,
                    optimizer: optax.GradientTransformation,
                    *,
                    head_graphdef: nnx.GraphDef | None = None,
                    head_optimizer: optax.GradientTransformation | None = None,
                    mesh: Mesh | None = None,
                    state_shardings: Any = None,
                    donate: bool = True,
                    on_policy_old_logp: bool = False,
                    joint_clip: float = 0.0,
                    dropout_seed: int = 0) -> Callable[[TrainState, TrainBatch], Any]:
  """Builds the jitted update ``(state, batch [K, b, ...]) -> (state, metrics)``.

  Args:
    graphdef: the policy's graph (from ``nnx.split(model, nnx.Param, ...)``).
    objective: what to optimise (`disa_jax.rl.objectives`).
    optimizer: the policy's optax transformation (see `make_optimizer`).
    head_graphdef, head_optimizer: the log Z head's graph and optimizer (objectives with
      ``needs_logz_head``).
    mesh: when given, the batch is sharded over ('data', 'fsdp') on its second axis and the state
      keeps ``state_shardings``.
    state_shardings: shardings of `TrainState` (e.g. ``jax.tree.map(lambda x: x.sharding, state)``).
    donate: donate the input state buffers.
    on_policy_old_logp: the batch was sampled from the current parameters and this is its only
      update (one mini-batch): pi_old is the policy itself, so ``old_logp`` is taken as the
      detached log-probs of this forward pass and ``batch.old_logp`` is ignored (saves the
      separate scoring pass; what TRL does with one iteration per batch).
    joint_clip: > 0: one global-norm clip at this value over the policy's and the head's gradients
      together, before both optimizers (which then must not clip themselves); FlowRL's code, where
      the head is part of the actor.
    dropout_seed: seeds the head's dropout (`FlowRL.head_dropout`), folded with the update count and
      the micro-batch index, so a resumed run draws the same masks.

  Returns:
    The jitted update. Metrics: the loss's metrics combined over micro-batches, plus ``loss``,
    ``grad_norm`` (before clipping), ``num_sequences`` (the summed normalizer) and, with a head,
    ``head_grad_norm``.
  """
  if objective.needs_logz_head and (head_graphdef is None or head_optimizer is None):
    raise ValueError(f"objective {objective.name!r} has a log Z head: it needs head_graphdef and "
                     "head_optimizer, got None")
  grad_fn = jax.value_and_grad(
      _micro_loss_fn(graphdef, objective, head_graphdef, on_policy_old_logp),
      argnums=(0, 1), has_aux=True)

  def step(state: TrainState, batch: TrainBatch):
    grads, head_grads, metrics = _accumulate(grad_fn, objective, state, batch, dropout_seed)
    return _apply_updates(state, grads, head_grads, metrics, optimizer, head_optimizer,
                          joint_clip)

  if mesh is None:
    return jax.jit(step, donate_argnums=(0,) if donate else ())
  batch_sharding = NamedSharding(mesh, PartitionSpec(None, BATCH_AXES))
  replicated = NamedSharding(mesh, PartitionSpec())
  return jax.jit(step,
                 in_shardings=(state_shardings, batch_sharding),
                 out_shardings=(state_shardings, replicated),
                 donate_argnums=(0,) if donate else ())


def init_train_state(model: nnx.Module,
                     optimizer: optax.GradientTransformation,
                     head: nnx.Module | None = None,
                     head_optimizer: optax.GradientTransformation | None = None,
                     *,
                     mesh: Mesh | None = None,
                     step: int = 0) -> tuple[nnx.GraphDef, nnx.GraphDef | None, TrainState, Any]:
  """Splits the policy (and head) into graph + params and initialises optimizer states.

  Policy parameters keep their current placement (shard the model first with
  `disa_jax.parallel.shard_model`); optimizer moments get the same shardings. With a ``mesh`` the
  step counter and the (small) head are replicated over it.

  Returns:
    (policy graphdef, head graphdef or None, TrainState, shardings of the TrainState).
  """
  graphdef, params = nnx.split(model, nnx.Param)
  put = (lambda x: x) if mesh is None else (
      lambda x: jax.device_put(x, NamedSharding(mesh, PartitionSpec())))
  head_graphdef = head_params = head_opt = None
  if head is not None:
    if head_optimizer is None:
      raise ValueError("a log Z head needs head_optimizer, got None")
    head_graphdef, head_params = nnx.split(head, nnx.Param)
    head_params = jax.tree.map(put, head_params)
    head_opt = jax.jit(head_optimizer.init)(head_params)
  opt_state = jax.jit(optimizer.init)(params)
  state = TrainState(jnp.asarray(step, jnp.int32), params, opt_state, head_params, head_opt)
  if mesh is not None:
    # Leaves created without a sharded input (step, optimizer counts, the head) are replicated.
    n = mesh.devices.size
    state = jax.tree.map(lambda x: x if len(x.sharding.device_set) == n else put(x), state)
  shardings = jax.tree.map(lambda x: x.sharding, state)
  return graphdef, head_graphdef, state, shardings


def make_scoring_fn(graphdef: nnx.GraphDef
                    ) -> Callable[[nnx.State, jax.Array, jax.Array], jax.Array]:
  """Jitted ``(params, input_ids [b, T], attention_mask [b, T]) -> [b, T]`` token log-probs.

  Used for the reference log-probs (frozen reference params) and for recomputing old log-probs
  with the policy before the updates. No gradient is taken.
  """

  @jax.jit
  def score(params, input_ids, attention_mask):
    return jax.lax.stop_gradient(
        token_logprobs(nnx.merge(graphdef, params), input_ids, attention_mask))

  return score
