"""The one optimizer builder and the one accumulate-and-apply gradient step of every trainer.

`make_optimizer`: AdamW on a learning-rate schedule after an optional global-norm clip, used by
Stage 3 (`disa_jax.rl`, with `lr_schedule`), the LoRA-SFT baseline and the main job's supervised
warm-up (`disa_jax.sft.supervised.SupervisedSchedule`, with its cosine / constant schedule).

`AccumulatingStep`: one optimizer update from a list of micro-batches. Micro-batch k runs one
jitted forward/backward of the caller's ``loss_fn``, which returns its loss and ``(w_k, c_k,
metrics)``; the step adds ``w_k * gradient`` and ``w_k * metric`` into a donated accumulator and
``c_k`` into a count, then a second jitted function divides the sums by ``max(sum_k c_k, 1)`` and
hands the gradients to the caller's ``apply_fn`` (the optimizer). Two weightings reproduce the
callers' losses exactly:

- a mean loss per micro-batch, ``w_k = c_k = n_k`` (its sequences or tokens): the gradient of the
  mean over the whole mini-batch (Stage 3, `disa_jax.rl.update`);
- a summed loss, ``w_k = 1``, ``c_k`` = its tokens: the token mean over the batch (LoRA-SFT,
  `disa_jax.sft.supervised.make_sft_step`).

(The main job's warm-up, one micro-batch per update, compiles its gradient and AdamW step as one
program instead, `make_sft_step(loss='batch_mean')`: split into this step's two programs, XLA
rounds the last bits of its parameters differently.)

One compiled micro step per micro-batch shape and one optimizer step, however many micro-batches
an update has (``compiled_programs()``); ``lower(state, micro_batch)`` lowers both without running
them (`benchmarks/plan_memory.py`).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import optax

__all__ = ["AccumulatingStep", "decay_boundary", "lr_schedule", "make_optimizer"]


def decay_boundary(decay_frac: float, total_updates: int) -> int | None:
  """The first optimizer update of `lr_schedule`'s low-rate phase (None: no decay phase)."""
  return int(round((1.0 - decay_frac) * total_updates)) if decay_frac > 0 else None


def lr_schedule(lr: float, *, warmup_steps: int = 0, decay_frac: float = 0.0,
                decay_factor: float = 0.1, total_updates: int = 0) -> optax.Schedule | float:
  """Linear warm-up, then ``lr``, then ``lr * decay_factor`` for the last ``decay_frac`` of the
  ``total_updates`` optimizer updates (a constant ``lr`` when neither is asked for)."""
  if decay_frac > 0 and total_updates < 1:
    raise ValueError(f"decay_frac={decay_frac} needs the run's total_updates, got {total_updates}")
  if warmup_steps <= 0 and decay_frac <= 0:
    return lr
  boundary = decay_boundary(decay_frac, total_updates)
  def schedule(count):
    value = lr * jnp.minimum(1.0, count / max(warmup_steps, 1)) if warmup_steps > 0 else lr
    if boundary is not None:
      value = jnp.where(count >= boundary, value * decay_factor, value)
    return value
  return schedule


def make_optimizer(lr: float | optax.Schedule, *, weight_decay: float = 0.01, b1: float = 0.9,
                   b2: float = 0.999, eps: float = 1e-8, grad_clip: float = 1.0,
                   warmup_steps: int = 0, decay_frac: float = 0.0, decay_factor: float = 0.1,
                   total_updates: int = 0) -> optax.GradientTransformation:
  """AdamW after global-norm clipping at ``grad_clip`` (<= 0: no clip, the bare AdamW).

  ``lr``: a peak rate scheduled by `lr_schedule` (``warmup_steps``, ``decay_frac``,
  ``decay_factor``, ``total_updates``), or an optax schedule used as it is (those four unset).
  """
  if callable(lr):
    if warmup_steps or decay_frac:
      raise ValueError(f"lr is a schedule: warmup_steps and decay_frac must be 0, got "
                       f"{warmup_steps!r}, {decay_frac!r}")
    schedule = lr
  else:
    schedule = lr_schedule(lr, warmup_steps=warmup_steps, decay_frac=decay_frac,
                           decay_factor=decay_factor, total_updates=total_updates)
  adamw = optax.adamw(schedule, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay)
  if grad_clip > 0:
    return optax.chain(optax.clip_by_global_norm(grad_clip), adamw)
  return adamw


def _fold_metrics(acc: dict[str, jax.Array], metrics: dict[str, jax.Array], w: jax.Array
                  ) -> dict[str, jax.Array]:
  """Adds one micro-batch's scalar metrics: running max/min for ``*_max``/``*_min``, else the
  w-weighted sum (divided by the summed count in `_final_metrics`)."""
  out = {}
  for k, v in metrics.items():
    if k.endswith("_max"):
      out[k] = jnp.maximum(acc[k], v)
    elif k.endswith("_min"):
      out[k] = jnp.minimum(acc[k], v)
    else:
      out[k] = acc[k] + w * v
  return out


def _metric_init(shapes: dict[str, Any]) -> dict[str, jax.Array]:
  return {k: jnp.full(v.shape, -jnp.inf if k.endswith("_max") else
                      jnp.inf if k.endswith("_min") else 0.0, jnp.float32)
          for k, v in shapes.items()}


def _final_metrics(acc: dict[str, jax.Array], total: jax.Array) -> dict[str, jax.Array]:
  total = jnp.maximum(total, 1.0)
  return {k: v if k.endswith(("_max", "_min")) else v / total for k, v in acc.items()}


def _micro_and_finish(loss_fn: Callable, apply_fn: Callable) -> tuple[Callable, Callable, Callable]:
  """(grad_fn, micro, finish) of an `AccumulatingStep` (see the module docstring)."""
  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

  def micro(params, const, step, acc, mb, k):
    (loss, (w, c, metrics)), g = grad_fn(params, const, mb, step, k)
    g_acc, c_acc, m_acc = acc
    return (jax.tree.map(lambda a, b: a + w * b, g_acc, g), c_acc + c,
            _fold_metrics(m_acc, dict(metrics, loss=loss), w))

  def finish(state, acc):
    g_sum, total, m_acc = acc
    denom = jnp.maximum(total, 1.0)
    grads = jax.tree.map(lambda x: x / denom, g_sum)
    return apply_fn(state, grads, _final_metrics(m_acc, total), total)

  return grad_fn, micro, finish


class AccumulatingStep:
  """``step(state, micro_batches, const=None) -> (state, metrics)``: one optimizer update.

  Args:
    loss_fn: ``(params, const, micro-batch, step, k) -> (loss, (w, c, metrics))``: the loss of
      micro-batch ``k`` of update ``step`` (an int32 scalar), differentiated with respect to
      ``params``; ``w`` weights its gradient and metrics, ``c`` counts towards the divisor
      (scalars); ``metrics`` a dict of scalars (``*_max`` / ``*_min``: max / min over
      micro-batches).
    apply_fn: ``(state, grads, metrics, total) -> (state, metrics)``: the optimizer step, given
      the accumulated gradients divided by ``max(total, 1)``, the combined metrics (with
      ``loss``) and ``total`` = sum_k c_k.
    params_of: ``state -> (params, step)``: what ``loss_fn`` differentiates, and the update count.
    donate: donate the state's buffers to the optimizer step.
    micro_kw, finish_kw, init_kw: ``jax.jit`` sharding arguments of the micro step ``(params,
      const, step, acc, micro-batch, k)``, the optimizer step ``(state, acc)`` and the
      accumulator's initialiser ``(params) -> acc``, where ``acc = (gradient sums like params,
      count, metrics)``; empty without a mesh.
    const: the loss's ``const`` of every call that gives none: an argument of the compiled micro
      step, never a constant folded into it (a run's PRNG key: runs of other seeds share one
      program and its compilation cache entry).
  """

  def __init__(self, loss_fn: Callable, apply_fn: Callable, params_of: Callable, *,
               donate: bool = True, micro_kw: dict[str, Any] | None = None,
               finish_kw: dict[str, Any] | None = None, init_kw: dict[str, Any] | None = None,
               const: Any = None):
    self._grad_fn, micro, finish = _micro_and_finish(loss_fn, apply_fn)
    self._params_of, self._init_kw, self._const = params_of, init_kw or {}, const
    self._ks: list[jax.Array] = []  # the micro-batch indices as device scalars, made once
    self._micro_j = jax.jit(micro, donate_argnums=(3,), **(micro_kw or {}))
    # (the accumulator's buffers match no output of the optimizer step)
    self._finish_j = jax.jit(finish, donate_argnums=(0,) if donate else (), **(finish_kw or {}))
    self._init_j = None

  def _init_acc(self, params: Any, const: Any, mb: Any) -> Callable:
    if self._init_j is None:  # built once the loss's metric names are known
      (_, (_, _, shapes)), _ = jax.eval_shape(self._grad_fn, params, const, mb,
                                              jnp.int32(0), jnp.int32(0))
      shapes = dict(shapes, loss=jax.ShapeDtypeStruct((), jnp.float32))
      self._init_j = jax.jit(lambda p: (jax.tree.map(jnp.zeros_like, p), jnp.float32(0.0),
                                        _metric_init(shapes)), **self._init_kw)
    return self._init_j

  def __call__(self, state: Any, micro_batches: Sequence[Any], const: Any = None):
    if not micro_batches:
      raise ValueError("an update needs at least one micro-batch, got none")
    const = self._const if const is None else const
    params, step = self._params_of(state)
    acc = self._init_acc(params, const, micro_batches[0])(params)
    self._ks += [jnp.int32(k) for k in range(len(self._ks), len(micro_batches))]
    for k, mb in enumerate(micro_batches):
      acc = self._micro_j(params, const, step, acc, mb, self._ks[k])
    return self._finish_j(state, acc)

  def lower(self, state: Any, mb: Any, const: Any = None) -> dict[str, jax.stages.Lowered]:
    """Lowers the micro step and the optimizer step without running anything.

    ``state`` and ``mb`` may be abstract (`jax.ShapeDtypeStruct` leaves, with shardings on a mesh).

    Returns:
      ``{'micro': the forward/backward + accumulate of one micro-batch, 'finish': the optimizer
      step}`` as `jax.stages.Lowered`.
    """
    const = self._const if const is None else const
    params, step = self._params_of(state)
    acc = jax.eval_shape(self._init_acc(params, const, mb), params)
    k = jax.ShapeDtypeStruct((), jnp.int32)
    return {"micro": self._micro_j.lower(params, const, step, acc, mb, k),
            "finish": self._finish_j.lower(state, acc)}

  def compiled_programs(self) -> int:
    """Compiled micro and optimizer steps so far (recompilations show up here)."""
    return self._micro_j._cache_size() + self._finish_j._cache_size()  # pylint: disable=protected-access
