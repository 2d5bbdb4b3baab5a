"""FlowRL's co-trained partition-function head log Z_phi(q) (eq. 4).

An MLP on the masked mean of the policy's final hidden state over the prompt tokens:
``num_layers - 1`` blocks of (Linear D->D, GELU, LayerNorm), then Linear D->1. It lives in its own
`nnx.Module`, separate from the policy `Transformer`, so that weight sync to the rollout engine and
HF export (which walk the policy only) never see it; the trainer keeps its parameters and optimizer
state beside the policy's. The head's input is not detached: as in FlowRL, where the head sits on
the actor's last hidden state, the TB loss also reaches the policy through the prompt embedding.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def masked_mean_embedding(hidden: jax.Array, prompt_mask: jax.Array) -> jax.Array:
  """Masked mean of hidden states over prompt tokens.

  Args:
    hidden: ``[B, T, D]`` final hidden states.
    prompt_mask: ``[B, T]`` 1 on prompt tokens, 0 elsewhere.

  Returns:
    ``[B, D]`` float32 (zeros for a row without prompt tokens).
  """
  if hidden.ndim != 3 or prompt_mask.shape != hidden.shape[:2]:
    raise ValueError(f"need hidden [B, T, D] and prompt_mask [B, T], got {hidden.shape} and "
                     f"{prompt_mask.shape}")
  m = jnp.asarray(prompt_mask, jnp.float32)
  total = jnp.einsum("btd,bt->bd", hidden.astype(jnp.float32), m)
  return total / jnp.maximum(m.sum(-1, keepdims=True), 1.0)


class LogZHead(nnx.Module):
  """log Z_phi head: ``[P, D]`` prompt embeddings -> ``[P]`` log Z.

  Attributes:
    hidden_size: D, the policy's hidden size.
    num_layers: number of Linear layers (>= 1); FlowRL uses 3.
  """

  def __init__(self,
               hidden_size: int,
               num_layers: int = 3,
               *,
               rngs: nnx.Rngs,
               init_bias: float = 0.0,
               param_dtype=jnp.float32):
    if hidden_size < 1:
      raise ValueError(f"LogZHead hidden_size must be >= 1, got {hidden_size!r}")
    if num_layers < 1:
      raise ValueError(f"LogZHead num_layers must be >= 1, got {num_layers!r}")
    self.hidden_size = hidden_size
    self.num_layers = num_layers
    self.linears = nnx.List([
        nnx.Linear(hidden_size, hidden_size, rngs=rngs, param_dtype=param_dtype)
        for _ in range(num_layers - 1)
    ])
    self.norms = nnx.List([
        nnx.LayerNorm(hidden_size, rngs=rngs, param_dtype=param_dtype)
        for _ in range(num_layers - 1)
    ])
    self.out = nnx.Linear(hidden_size, 1, rngs=rngs, param_dtype=param_dtype,
                          bias_init=nnx.initializers.constant(init_bias))

  def __call__(self, embeddings: jax.Array) -> jax.Array:
    """Args: embeddings ``[P, D]``. Returns: ``[P]`` float32 log Z values."""
    if embeddings.ndim != 2 or embeddings.shape[-1] != self.hidden_size:
      raise ValueError(f"LogZHead expects embeddings [P, {self.hidden_size}], got "
                       f"{embeddings.shape}")
    x = embeddings.astype(jnp.float32)
    for linear, norm in zip(self.linears, self.norms):
      x = norm(jax.nn.gelu(linear(x), approximate=False))
    return self.out(x)[:, 0].astype(jnp.float32)  # [P, 1] -> [P]
