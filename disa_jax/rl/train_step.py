"""The jitted Stage 3 update: micro-batched gradient accumulation, AdamW, sharded over a Mesh.

One call of the function built by `make_train_step` performs one optimizer update on one
mini-batch. The mini-batch arrives already split into micro-batches: every array has a leading
micro-batch axis ``[K, b, ...]`` (K micro-batches of b sequences), sharded over the mesh's batch
axes on ``b``. The micro-batches run in a `lax.scan`; micro-batch k's gradient is weighted by its
number of valid sequences n_k, so that the accumulated gradient equals the gradient of the loss
averaged over all valid sequences of the mini-batch (every loss in `disa_jax.rl.losses` is a mean
over valid rows).

Batch fields (``[K, b, T]`` unless noted):
  ``input_ids`` int32, ``attention_mask`` (1 real / 0 pad), ``prompt_mask`` (1 on prompt tokens),
  ``response_mask`` (1 on response tokens), ``old_logp``, ``ref_logp`` float32 token log-probs
  aligned with the tokens (entry t scores token t), and ``[K, b]`` float32 ``reward`` (transformed
  r~, TB methods), ``advantage`` (GRPO / GSPO), ``log_z`` (DISA: the anchor's value for the row's
  prompt; ignored otherwise).

The FlowRL log Z head is a separate module with its own parameters and optimizer state (`TrainState`
``head_params`` / ``head_opt_state``), never part of the policy's state.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from disa_jax.rl import losses
from disa_jax.rl.config import LossCfg
from disa_jax.rl.logz_head import masked_mean_embedding

LogprobFn = Callable[[nnx.Module, jax.Array, jax.Array], jax.Array]
BATCH_AXES = ("data", "fsdp")
TOKEN_FIELDS = ("input_ids", "attention_mask", "prompt_mask", "response_mask", "old_logp",
                "ref_logp")
ROW_FIELDS = ("reward", "advantage", "log_z")


# What the update optimises: the run's validated loss section (method, beta, scale, omega, clips, KL).
LossSettings = LossCfg


class TrainState(NamedTuple):
  """Everything the update changes. ``head_*`` are None unless the method is FlowRL."""
  step: jax.Array  # int32 scalar: optimizer updates done
  params: nnx.State  # policy nnx.Param state
  opt_state: Any
  head_params: nnx.State | None
  head_opt_state: Any


def make_optimizer(lr: float, *, weight_decay: float = 0.01, b1: float = 0.9, b2: float = 0.999,
                   eps: float = 1e-8, grad_clip: float = 1.0,
                   warmup_steps: int = 0) -> optax.GradientTransformation:
  """AdamW with an optional linear warm-up, after global-norm clipping (``grad_clip`` <= 0: off)."""
  schedule = optax.linear_schedule(0.0, lr, warmup_steps) if warmup_steps > 0 else lr
  adamw = optax.adamw(schedule, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay)
  if grad_clip > 0:
    return optax.chain(optax.clip_by_global_norm(grad_clip), adamw)
  return adamw


def default_logprob_fn() -> LogprobFn:
  """`disa_jax.scoring.token_logprobs` (imported lazily)."""
  from disa_jax import scoring  # pylint: disable=g-import-not-at-top
  return scoring.token_logprobs


def compute_loss(settings: LossSettings, logp: jax.Array, mb: dict[str, jax.Array],
                 head_log_z: jax.Array | None = None, *, use_ref: bool = True
                 ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Dispatches to the method's loss for one micro-batch (arrays ``[b, T]`` / ``[b]``).

  ``use_ref=False`` (GRPO / GSPO without a KL penalty): ``mb['ref_logp']`` is not read, so the
  reference need not be scored; GRPO then reports no ``kl_ref``.
  """
  s = settings
  mask = mb["response_mask"]
  if s.method in ("disa", "flowrl"):
    log_z = mb["log_z"] if s.method == "disa" else head_log_z
    fn = losses.disa_loss if s.method == "disa" else losses.flowrl_loss
    return fn(log_z, logp, mb["ref_logp"], mb["reward"], mask, beta=s.beta,
              length_normalize=s.length_normalize, old_logp=mb["old_logp"],
              omega_mode=s.omega_mode, omega_max=s.omega_max)
  if s.method == "grpo":
    return losses.grpo_loss(logp, mb["old_logp"], mb["advantage"], mask, eps_low=s.eps_low,
                            eps_high=s.eps_high, dual_clip=s.dual_clip or None,
                            ref_logp=mb["ref_logp"] if use_ref else None, kl_coef=s.kl_coef,
                            kl_kind=s.kl_kind)
  return losses.gspo_loss(logp, mb["old_logp"], mb["advantage"], mask, eps_low=s.eps_low,
                          eps_high=s.eps_high)


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


def make_train_step(graphdef: nnx.GraphDef,
                    settings: LossSettings,
                    optimizer: optax.GradientTransformation,
                    *,
                    head_graphdef: nnx.GraphDef | None = None,
                    head_optimizer: optax.GradientTransformation | None = None,
                    logprob_fn: LogprobFn | None = None,
                    prompt_width: int | None = None,
                    mesh: Mesh | None = None,
                    state_shardings: Any = None,
                    donate: bool = True,
                    on_policy_old_logp: bool = False,
                    use_ref: bool = True) -> Callable[[TrainState, dict[str, jax.Array]], Any]:
  """Builds the jitted update ``(state, batch) -> (state, metrics)``.

  Args:
    graphdef: the policy's graph (from ``nnx.split(model, nnx.Param, ...)``).
    settings: the loss to optimise.
    optimizer: the policy's optax transformation (see `make_optimizer`).
    head_graphdef, head_optimizer: the FlowRL log Z head's graph and optimizer (FlowRL only).
    logprob_fn: ``(model, input_ids [b, T], attention_mask [b, T]) -> [b, T]`` token log-probs;
      default `disa_jax.scoring.token_logprobs`.
    prompt_width: FlowRL only: prompts occupy the first ``prompt_width`` columns; the head's input
      is computed from a forward over those columns only (default: all T).
    mesh: when given, the batch is sharded over ('data', 'fsdp') on its second axis and the state
      keeps ``state_shardings``.
    state_shardings: shardings of `TrainState` (e.g. ``jax.tree.map(lambda x: x.sharding, state)``).
    donate: donate the input state buffers.
    on_policy_old_logp: the batch was sampled from the current parameters and this is its only
      update (one mini-batch): pi_old is the policy itself, so ``old_logp`` is taken as the
      detached log-probs of this forward pass and ``batch['old_logp']`` is ignored (saves the
      separate scoring pass; what TRL does with one iteration per batch).
    use_ref: read ``batch['ref_logp']`` (see `compute_loss`); required for DISA / FlowRL and for
      a GRPO KL penalty.

  Returns:
    The jitted update. Metrics: the loss's metrics combined over micro-batches, plus ``loss``,
    ``grad_norm`` (before clipping), ``num_sequences`` and, for FlowRL, ``head_grad_norm``.
  """
  flowrl = settings.method == "flowrl"
  if flowrl and (head_graphdef is None or head_optimizer is None):
    raise ValueError("method 'flowrl' needs head_graphdef and head_optimizer, got None")
  logprob_fn = logprob_fn or default_logprob_fn()
  if not use_ref and (settings.method in ("disa", "flowrl") or settings.kl_coef > 0):
    raise ValueError(f"use_ref=False but loss.method={settings.method!r} / kl_coef="
                     f"{settings.kl_coef} needs the reference log-probs")

  def micro_loss(params, head_params, mb):
    model = nnx.merge(graphdef, params)
    logp = logprob_fn(model, mb["input_ids"], mb["attention_mask"])
    if on_policy_old_logp:
      mb = dict(mb, old_logp=jax.lax.stop_gradient(logp))
    head_log_z = None
    if flowrl:
      w = min(prompt_width or mb["input_ids"].shape[1], mb["input_ids"].shape[1])
      hidden = model.hidden_states(mb["input_ids"][:, :w],
                                   attention_mask=mb["attention_mask"][:, :w])  # [b, w, D]
      emb = masked_mean_embedding(hidden, mb["prompt_mask"][:, :w])  # [b, D]
      head_log_z = nnx.merge(head_graphdef, head_params)(emb)  # [b]
    return compute_loss(settings, logp, mb, head_log_z, use_ref=use_ref)

  grad_fn = jax.value_and_grad(micro_loss, argnums=(0, 1), has_aux=True)

  def step(state: TrainState, batch: dict[str, jax.Array]):
    for k in TOKEN_FIELDS + ROW_FIELDS:
      if k not in batch:
        raise ValueError(f"train batch is missing field {k!r}; has {sorted(batch)}")
    zeros = lambda t: jax.tree.map(jnp.zeros_like, t)
    init = (zeros(state.params), zeros(state.head_params), jnp.float32(0.0))

    def body(carry, mb):
      g_acc, hg_acc, n_acc = carry
      (loss, metrics), (g, hg) = grad_fn(state.params, state.head_params, mb)
      n = losses.valid_rows(mb["response_mask"]).sum().astype(jnp.float32)
      g_acc = jax.tree.map(lambda a, b: a + n * b, g_acc, g)
      hg_acc = jax.tree.map(lambda a, b: a + n * b, hg_acc, hg)
      metrics = dict(metrics, loss=loss)
      return (g_acc, hg_acc, n_acc + n), (metrics, n)

    (g_sum, hg_sum, n_total), (stacked, counts) = jax.lax.scan(body, init, batch)
    denom = jnp.maximum(n_total, 1.0)
    grads = jax.tree.map(lambda x: x / denom, g_sum)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = _combine_metrics(stacked, counts)
    metrics["grad_norm"] = optax.global_norm(grads)
    metrics["num_sequences"] = n_total
    head_params, head_opt_state = state.head_params, state.head_opt_state
    if flowrl:
      head_grads = jax.tree.map(lambda x: x / denom, hg_sum)
      h_updates, head_opt_state = head_optimizer.update(head_grads, head_opt_state, head_params)
      head_params = optax.apply_updates(head_params, h_updates)
      metrics["head_grad_norm"] = optax.global_norm(head_grads)
    return TrainState(state.step + 1, params, opt_state, head_params, head_opt_state), metrics

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


def split_micro_batches(batch: dict[str, Any], micro_batch_size: int) -> dict[str, Any]:
  """Reshapes every field ``[M, ...]`` -> ``[M // b, b, ...]`` (numpy or jax arrays)."""
  out = {}
  for k, v in batch.items():
    m = v.shape[0]
    if m % micro_batch_size:
      raise ValueError(f"mini-batch of {m} rows (field {k!r}) is not divisible by "
                       f"micro_batch_size={micro_batch_size}")
    out[k] = v.reshape((m // micro_batch_size, micro_batch_size) + v.shape[1:])  # [M] -> [K, b]
  return out


def make_scoring_fn(graphdef: nnx.GraphDef, logprob_fn: LogprobFn | None = None
                    ) -> Callable[[nnx.State, jax.Array, jax.Array], jax.Array]:
  """Jitted ``(params, input_ids [b, T], attention_mask [b, T]) -> [b, T]`` token log-probs.

  Used for the reference log-probs (frozen reference params) and for recomputing old log-probs
  with the policy before the updates. No gradient is taken.
  """
  logprob_fn = logprob_fn or default_logprob_fn()

  @jax.jit
  def score(params, input_ids, attention_mask):
    model = nnx.merge(graphdef, params)
    return jax.lax.stop_gradient(logprob_fn(model, input_ids, attention_mask))

  return score
