"""FlowRL's co-trained partition-function head log Z_phi(q) (eq. 6).

An MLP on a masked mean of the policy's final hidden state over the prompt tokens (a segment mean
over packed rows, `packed_mean_embedding`):
``num_layers - 1`` blocks of (Linear D->D, GELU, LayerNorm, Dropout), then Linear D->1. It lives in
its own `nnx.Module`, separate from the policy `Transformer`, so that weight sync to the rollout
engine and HF export (which walk the policy only) never see it; the trainer keeps its parameters and
optimizer state beside the policy's. The head's input is not detached: as in FlowRL, where the head
sits on the actor's last hidden state, the TB loss also reaches the policy through the prompt
embedding.

The paper says nothing about the head, so every default follows FlowRL: ``ProjZModule`` in
github.com/Xuekai-Zhu/FlowRL ``verl@FlowRL/verl/workers/fsdp_workers.py`` (the same class is in
veRL's ``recipe/flowrl/flowrl_actor.py``): ``num_layers=3`` (``porj_layer=3`` in its run scripts),
exact GELU, ``torch.nn.LayerNorm`` (eps 1e-5), ``Dropout(0.1)`` after each LayerNorm, and
``torch.nn.Linear``'s default initialisation. Its input, in ``DataParallelPPOActor.
_forward_micro_batch``, is ``masked_mean`` of the last hidden states over the prompt columns
``[:, :-response_length - 1]``, i.e. every prompt position but the last one
(``pooling='exclude_last_prompt_token'``).

Dropout is applied only when `LogZHead.__call__` is given a ``dropout_key`` (FlowRL's update runs
the actor in ``train()`` mode, so its dropout is on while the TB loss is differentiated); without a
key the head is deterministic (``eval()`` mode). The key is an explicit input, so the head stays a
pure function of (parameters, embeddings, key) and jits.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from disa_jax.scoring.logprobs import segment_mean

POOLINGS = ("exclude_last_prompt_token", "all_prompt_tokens")
INITS = ("torch", "flax")


def packed_pooling_mask(prompt_mask: jax.Array, token_slot: jax.Array,
                        pooling: str = "exclude_last_prompt_token") -> jax.Array:
  """The positions the head's input averages over, in packed rows (any number of sequences per
  row, each prompt contiguous).

  Args:
    prompt_mask: ``[R, L]`` 1 on prompt tokens, 0 elsewhere.
    token_slot: ``[R, L]`` the sequence slot of each token (`disa_jax.data.packing.PackedRows`).
    pooling: ``exclude_last_prompt_token`` (FlowRL: every prompt position but the last prompt
      token of each sequence) | ``all_prompt_tokens``.

  Returns:
    ``[R, L]`` bool.
  """
  if pooling not in POOLINGS:
    raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
  m = jnp.asarray(prompt_mask) > 0
  if pooling == "all_prompt_tokens":
    return m
  slot = jnp.asarray(token_slot)
  # A prompt token is the last one of its sequence unless the next token is a prompt token of
  # the same sequence.
  followed = m[:, 1:] & (slot[:, 1:] == slot[:, :-1])
  return m & jnp.concatenate([followed, jnp.zeros_like(m[:, :1])], axis=1)


def _row_slots(prompt_mask: jax.Array) -> jax.Array:
  """``[B, T]`` slot ids of a padded batch: the row index on prompt tokens, B elsewhere."""
  b = prompt_mask.shape[0]
  return jnp.where(jnp.asarray(prompt_mask) > 0, jnp.arange(b, dtype=jnp.int32)[:, None], b)


def pooling_mask(prompt_mask: jax.Array, pooling: str = "exclude_last_prompt_token") -> jax.Array:
  """`packed_pooling_mask` of a padded batch (one sequence per row).

  Args:
    prompt_mask: ``[B, T]`` 1 on prompt tokens, 0 elsewhere (left or right padding).
    pooling: see `packed_pooling_mask`.

  Returns:
    ``[B, T]`` bool.
  """
  return packed_pooling_mask(prompt_mask, _row_slots(prompt_mask), pooling)


def packed_mean_embedding(hidden: jax.Array, prompt_mask: jax.Array, token_slot: jax.Array,
                          num_slots: int, *, pooling: str = "exclude_last_prompt_token"
                          ) -> jax.Array:
  """Per-sequence mean of packed hidden states over the positions `packed_pooling_mask` selects.

  Args:
    hidden: ``[R, L, D]`` final hidden states of packed rows.
    prompt_mask: ``[R, L]`` 1 on prompt tokens.
    token_slot: ``[R, L]`` the sequence slot of each token (S = ``num_slots`` on padding).
    num_slots: S.
    pooling: see `packed_pooling_mask`; the default is FlowRL's (the paper is silent).

  Returns:
    ``[S, D]`` float32 (zeros for a slot with no selected position, e.g. an empty slot or a
    one-token prompt under ``exclude_last_prompt_token``).
  """
  if hidden.ndim != 3 or prompt_mask.shape != hidden.shape[:2] or token_slot.shape != hidden.shape[:2]:
    raise ValueError(f"need hidden [R, L, D], prompt_mask and token_slot [R, L], got "
                     f"{hidden.shape}, {prompt_mask.shape} and {token_slot.shape}")
  weights = packed_pooling_mask(prompt_mask, token_slot, pooling)
  return segment_mean(hidden, weights, token_slot, num_slots)


def masked_mean_embedding(hidden: jax.Array,
                          prompt_mask: jax.Array,
                          *,
                          pooling: str = "exclude_last_prompt_token") -> jax.Array:
  """`packed_mean_embedding` of a padded batch (one sequence per row).

  Args:
    hidden: ``[B, T, D]`` final hidden states.
    prompt_mask: ``[B, T]`` 1 on prompt tokens, 0 elsewhere.
    pooling: see `packed_pooling_mask`.

  Returns:
    ``[B, D]`` float32 (zeros for a row with no selected position).
  """
  if hidden.ndim != 3 or prompt_mask.shape != hidden.shape[:2]:
    raise ValueError(f"need hidden [B, T, D] and prompt_mask [B, T], got {hidden.shape} and "
                     f"{prompt_mask.shape}")
  return packed_mean_embedding(hidden, prompt_mask, _row_slots(prompt_mask), hidden.shape[0],
                               pooling=pooling)


def _torch_uniform(fan_in: int, shift: float = 0.0):
  """torch.nn.Linear's default bias init U(-1/sqrt(fan_in), 1/sqrt(fan_in)), plus ``shift``."""
  bound = 1.0 / math.sqrt(fan_in)

  def init(key, shape, dtype=jnp.float32):
    return jax.random.uniform(key, shape, dtype, -bound, bound) + jnp.asarray(shift, dtype)

  return init


def dropout(x: jax.Array, rate: float, key: jax.Array | None) -> jax.Array:
  """Inverted dropout as ``torch.nn.Dropout`` in train mode; identity when ``key`` is None."""
  if key is None or rate == 0.0:
    return x
  keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
  return jnp.where(keep, x / (1.0 - rate), 0.0)


class LogZHead(nnx.Module):
  """log Z_phi head: ``[N, D]`` prompt embeddings -> ``[N]`` log Z (N = P prompts or B rows).

  Attributes:
    hidden_size: D, the policy's hidden size.
    num_layers: number of Linear layers (>= 1); FlowRL uses 3.
    dropout_rate: dropout after each LayerNorm when a key is given (FlowRL: 0.1).
  """

  def __init__(self,
               hidden_size: int,
               num_layers: int = 3,
               *,
               rngs: nnx.Rngs,
               init_bias: float = 0.0,
               param_dtype=jnp.float32,
               dropout_rate: float = 0.1,
               layer_norm_eps: float = 1e-5,
               init: str = "torch"):
    """Builds the head.

    Args:
      hidden_size: D.
      num_layers: Linear layers (>= 1).
      rngs: parameter initialisation.
      init_bias: added to the output bias at initialisation (the initial log Z offset; FlowRL: 0).
      param_dtype: parameter dtype.
      dropout_rate: in [0, 1); FlowRL 0.1.
      layer_norm_eps: LayerNorm epsilon; FlowRL (torch default) 1e-5.
      init: ``torch`` (FlowRL: kernel and bias U(+-1/sqrt(fan_in)), as ``torch.nn.Linear``) |
        ``flax`` (LeCun-normal kernels, zero biases).
    """
    if hidden_size < 1:
      raise ValueError(f"LogZHead hidden_size must be >= 1, got {hidden_size!r}")
    if num_layers < 1:
      raise ValueError(f"LogZHead num_layers must be >= 1, got {num_layers!r}")
    if not 0.0 <= dropout_rate < 1.0:
      raise ValueError(f"LogZHead dropout_rate must be in [0, 1), got {dropout_rate!r}")
    if init not in INITS:
      raise ValueError(f"LogZHead init must be one of {INITS}, got {init!r}")
    self.hidden_size = hidden_size
    self.num_layers = num_layers
    self.dropout_rate = dropout_rate
    kw = {}
    out_bias = nnx.initializers.constant(init_bias)
    if init == "torch":
      kw = {"kernel_init": nnx.initializers.variance_scaling(1.0 / 3.0, "fan_in", "uniform"),
            "bias_init": _torch_uniform(hidden_size)}
      out_bias = _torch_uniform(hidden_size, init_bias)
    self.linears = nnx.List([
        nnx.Linear(hidden_size, hidden_size, rngs=rngs, param_dtype=param_dtype, **kw)
        for _ in range(num_layers - 1)
    ])
    self.norms = nnx.List([
        nnx.LayerNorm(hidden_size, epsilon=layer_norm_eps, rngs=rngs, param_dtype=param_dtype)
        for _ in range(num_layers - 1)
    ])
    self.out = nnx.Linear(hidden_size, 1, rngs=rngs, param_dtype=param_dtype,
                          kernel_init=kw.get("kernel_init", nnx.initializers.lecun_normal()),
                          bias_init=out_bias)

  def __call__(self, embeddings: jax.Array, *, dropout_key: jax.Array | None = None) -> jax.Array:
    """Applies the head.

    Args:
      embeddings: ``[N, D]`` prompt embeddings (see `masked_mean_embedding`).
      dropout_key: a PRNG key to train with dropout (independent masks per row and layer), or
        None for the deterministic head.

    Returns:
      ``[N]`` float32 log Z values.
    """
    if embeddings.ndim != 2 or embeddings.shape[-1] != self.hidden_size:
      raise ValueError(f"LogZHead expects embeddings [N, {self.hidden_size}], got "
                       f"{embeddings.shape}")
    x = embeddings.astype(jnp.float32)
    for i, (linear, norm) in enumerate(zip(self.linears, self.norms)):
      x = norm(jax.nn.gelu(linear(x), approximate=False))
      key = None if dropout_key is None else jax.random.fold_in(dropout_key, i)
      x = dropout(x, self.dropout_rate, key)
    return self.out(x)[:, 0].astype(jnp.float32)  # [N, 1] -> [N]
