"""Supervised fine-tuning on (prompt, response) pairs: the loss and the jitted AdamW update.

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

from disa_jax.optim import AccumulatingStep, make_optimizer
from disa_jax.scoring import packed_token_logprobs, token_logprobs


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

  def lr_schedule(self) -> optax.Schedule:
    """The learning rate per update: linear warm-up from 0 over ``warmup_steps`` (none: the first
    update uses the full rate), then cosine to lr / 10 at ``total_steps`` or constant."""
    lr = self.learning_rate
    if self.schedule == "cosine":
      decay = optax.cosine_decay_schedule(lr, max(self.total_steps - self.warmup_steps, 1), alpha=0.1)
    else:
      decay = optax.constant_schedule(lr)
    if self.warmup_steps > 0:
      return optax.join_schedules([optax.linear_schedule(0.0, lr, self.warmup_steps), decay],
                                  [self.warmup_steps])
    return decay

  def optimizer(self) -> optax.GradientTransformation:
    """`disa_jax.optim.make_optimizer` on `lr_schedule` (AdamW, the default betas and eps)."""
    return make_optimizer(self.lr_schedule(), weight_decay=self.weight_decay,
                          grad_clip=self.grad_clip)


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


SFT_LOSSES = ("token_mean", "batch_mean")


def _token_sum_loss(graphdef: nnx.GraphDef) -> Callable:
  """The `disa_jax.optim.AccumulatingStep` loss of one packed micro-batch: its response tokens'
  summed NLL, weight 1, counted by its response tokens (the batch's token mean)."""
  one = jnp.float32(1.0)

  def micro_loss(params, rest, rows, step, k):
    del step, k
    lp = packed_token_logprobs(nnx.merge(graphdef, params, rest), rows)  # [R, L]
    m = rows.response_mask.astype(jnp.float32)
    return -jnp.sum(lp * m), (one, jnp.sum(m), {})

  return micro_loss


def _accumulating_sft_step(tx: optax.GradientTransformation, graphdef: nnx.GraphDef) -> Callable:
  """'token_mean' of `make_sft_step`: the shared `disa_jax.optim.AccumulatingStep`."""

  def apply(state, grads, metrics, total):
    del total
    params, opt_state = state
    updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), metrics["loss"]

  update = AccumulatingStep(_token_sum_loss(graphdef), apply,
                            lambda state: (state[0], jnp.int32(0)), donate=False)

  def step(params, opt_state, rest, micro_batches):
    (params, opt_state), value = update((params, opt_state), micro_batches, rest)
    return params, opt_state, value

  return step


def _fused_sft_step(tx: optax.GradientTransformation, graphdef: nnx.GraphDef) -> Callable:
  """'batch_mean' of `make_sft_step`: gradient and AdamW step in one compiled program."""

  @jax.jit
  def fused(params, opt_state, rest, batch):
    loss, grads = jax.value_and_grad(
        lambda p: batch_loss(nnx.merge(graphdef, p, rest), batch))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  def step(params, opt_state, rest, micro_batches):
    if len(micro_batches) != 1:
      raise ValueError(f"loss='batch_mean' takes one micro-batch per update, got "
                       f"{len(micro_batches)}")
    return fused(params, opt_state, rest, micro_batches[0])

  return step


def make_sft_step(config: SupervisedSchedule, graphdef: nnx.GraphDef, *, loss: str = "token_mean"
                  ) -> tuple[optax.GradientTransformation, Callable]:
  """One supervised update (AdamW of `SupervisedSchedule.optimizer`).

  Args:
    config: optimiser settings.
    graphdef: from ``nnx.split(model, wrt, ...)``: ``wrt`` the trainable variables (``nnx.Param``
      for full fine-tuning, ``lora.LoRAParam`` for adapters), the rest frozen.
    loss: 'token_mean': the response-token mean NLL over the whole batch, accumulated over its
      micro-batches (each a `disa_jax.data.packing.PackedRows` ``[R, L]``) by the shared
      `disa_jax.optim.AccumulatingStep` (the LoRA-SFT baseline). 'batch_mean': one micro-batch
      per update (a dict of ``[B, T]`` arrays as `batch_loss` reads), the gradient of its token
      mean and the AdamW step compiled as one program (the main job's warm-up: the accumulating
      step's two programs round its last bits differently).

  Returns:
    (tx, step) with ``step(params, opt_state, rest, micro_batches) -> (params, opt_state,
    loss)``; ``opt_state = tx.init(params)``.
  """
  if loss not in SFT_LOSSES:
    raise ValueError(f"loss must be one of {SFT_LOSSES}, got {loss!r}")
  tx = config.optimizer()
  build = _accumulating_sft_step if loss == "token_mean" else _fused_sft_step
  return tx, build(tx, graphdef)
