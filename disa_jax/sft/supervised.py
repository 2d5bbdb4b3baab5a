"""Supervised fine-tuning on (prompt, response) pairs: the loss and a jitted AdamW update.

Used to warm up the main job's reference and proposal models, and as the optimiser core of the
LoRA-SFT baseline (App. D.4), which trains only adapter parameters with the same loss.

The loss is the mean negative log-likelihood of the response tokens,

    L = - sum_{b,t} response_mask[b,t] * log p(x[b,t] | x[b,<t]) / sum_{b,t} response_mask[b,t],

computed with the chunked scorer (float32 log-softmax, no [B, T, V] float32 logits). A batch is
padded rows (``attention_mask``) or packed rows (``segment_ids`` and ``positions``, from
`disa_jax.data.packing.PackedRows`; the default of the callers).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from disa_jax.scoring import token_logprobs


@dataclasses.dataclass(frozen=True)
class SupervisedSchedule:
  """Optimiser settings for supervised fine-tuning."""

  learning_rate: float = 2e-5  # App. D.4 uses 2e-5 for LoRA-SFT
  warmup_steps: int = 0
  total_steps: int = 1000  # for the cosine schedule
  schedule: str = "cosine"  # cosine | constant
  weight_decay: float = 0.0
  grad_clip: float = 1.0  # global-norm clip; 0 disables

  def __post_init__(self):
    if not self.learning_rate > 0:
      raise ValueError(f"SupervisedSchedule.learning_rate must be > 0, got {self.learning_rate!r}")
    if self.schedule not in ("cosine", "constant"):
      raise ValueError(f"SupervisedSchedule.schedule must be 'cosine' or 'constant', got {self.schedule!r}")
    if self.total_steps < 1 or self.warmup_steps < 0:
      raise ValueError(f"SupervisedSchedule needs total_steps >= 1 and warmup_steps >= 0, got "
                       f"{self.total_steps}, {self.warmup_steps}")

  def optimizer(self) -> optax.GradientTransformation:
    lr = self.learning_rate
    if self.schedule == "cosine":
      decay = optax.cosine_decay_schedule(lr, max(self.total_steps - self.warmup_steps, 1), alpha=0.1)
    else:
      decay = optax.constant_schedule(lr)
    if self.warmup_steps > 0:  # linear warm-up from 0; with none, the first update uses the full rate
      sched = optax.join_schedules([optax.linear_schedule(0.0, lr, self.warmup_steps), decay], [self.warmup_steps])
    else:
      sched = decay
    parts = [optax.clip_by_global_norm(self.grad_clip)] if self.grad_clip > 0 else []
    return optax.chain(*parts, optax.adamw(sched, weight_decay=self.weight_decay))


def sft_loss(model: nnx.Module, input_ids: jax.Array, attention_mask: jax.Array | None,
             response_mask: jax.Array, *, segment_ids: jax.Array | None = None,
             positions: jax.Array | None = None) -> jax.Array:
  """Mean NLL of response tokens.

  Args:
    model: a `disa_jax.models.Transformer` (or anything `token_logprobs` accepts).
    input_ids: ``[B, T]`` prompt + response tokens (padded or packed rows).
    attention_mask: ``[B, T]`` 1 on real tokens (padded rows); None with ``segment_ids``.
    response_mask: ``[B, T]`` 1 on the tokens to learn.
    segment_ids: ``[B, T]`` packed rows: 0 = padding, k = the row's k-th sequence.
    positions: ``[B, T]`` positions of packed rows (default: restarting in each segment).

  Returns:
    scalar float32.
  """
  lp = token_logprobs(model, input_ids, attention_mask, segment_ids=segment_ids,
                      positions=positions)  # [B, T]
  m = response_mask.astype(jnp.float32)
  return -jnp.sum(lp * m) / jnp.maximum(jnp.sum(m), 1.0)


def batch_loss(model: nnx.Module, batch: Mapping[str, Any]) -> jax.Array:
  """`sft_loss` of a batch dict: ``input_ids`` and ``response_mask``, with ``attention_mask``
  (padded rows) or ``segment_ids`` and optionally ``positions`` (packed rows)."""
  return sft_loss(model, batch["input_ids"], batch.get("attention_mask"), batch["response_mask"],
                  segment_ids=batch.get("segment_ids"), positions=batch.get("positions"))


def make_sft_step(config: SupervisedSchedule, wrt=nnx.Param) -> tuple[Callable, Callable]:
  """Returns (init, step): ``opt = init(model)``; ``loss = step(model, opt, batch)`` updates in place.

  Args:
    config: optimiser settings.
    wrt: the NNX filter of trainable variables (``nnx.Param`` for full fine-tuning, the LoRA
      variable type for adapters).

  The batch is a dict of ``[B, T]`` arrays as `batch_loss` reads (padded or packed rows).
  """
  tx = config.optimizer()

  def init(model: nnx.Module) -> nnx.Optimizer:
    return nnx.Optimizer(model, tx, wrt=wrt)

  @nnx.jit
  def step(model: nnx.Module, optimizer: nnx.Optimizer, batch: dict[str, jax.Array]) -> jax.Array:
    loss, grads = nnx.value_and_grad(lambda m: batch_loss(m, batch),
                                     argnums=nnx.DiffState(0, wrt))(model)
    optimizer.update(model, grads)
    return loss

  return init, step
