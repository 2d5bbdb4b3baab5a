"""The Stage 2 regressor g_psi: a small MLP from frozen prompt embeddings to log Z(q).

App. D.2 (Table 6): a two-layer MLP of hidden width 64 with a scalar output. Inputs and labels are
standardised with statistics of the training split (stored in the module as non-trainable
`Standardizer` variables), so the same learning rate works for embeddings and labels of any scale.
"""
from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

ACTIVATIONS = {"relu": jax.nn.relu, "gelu": jax.nn.gelu, "tanh": jnp.tanh, "silu": jax.nn.silu}


class Standardizer(nnx.Variable):
  """Non-trainable normalisation statistics (fitted once on the training split)."""


class AnchorMLP(nnx.Module):
  """g_psi(e) = y_mean + y_std * MLP((e - x_mean) / x_std).

  Args:
    in_dim: embedding width D.
    hidden_sizes: widths of the hidden layers; ``(64,)`` gives the paper's two-layer MLP.
    activation: one of ``ACTIVATIONS``.
    rngs: parameter initialisation RNGs.
  """

  def __init__(self, in_dim: int, hidden_sizes: Sequence[int] = (64,), activation: str = "relu", *,
               rngs: nnx.Rngs):
    if activation not in ACTIVATIONS:
      raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
    if in_dim < 1 or any(h < 1 for h in hidden_sizes):
      raise ValueError(f"in_dim and hidden_sizes must be >= 1, got {in_dim}, {tuple(hidden_sizes)}")
    self.activation = activation
    widths = [in_dim, *hidden_sizes, 1]
    self.layers = nnx.List([nnx.Linear(a, b, rngs=rngs) for a, b in zip(widths[:-1], widths[1:])])
    self.x_mean = Standardizer(jnp.zeros((in_dim,), jnp.float32))
    self.x_std = Standardizer(jnp.ones((in_dim,), jnp.float32))
    self.y_mean = Standardizer(jnp.zeros((), jnp.float32))
    self.y_std = Standardizer(jnp.ones((), jnp.float32))

  def set_standardization(self, x: jax.Array, y: jax.Array) -> None:
    """Fits the input/label statistics on training data ``x [P, D]``, ``y [P]``."""
    self.x_mean.value = jnp.mean(x, axis=0)
    self.x_std.value = jnp.maximum(jnp.std(x, axis=0), 1e-6)
    self.y_mean.value = jnp.mean(y)
    self.y_std.value = jnp.maximum(jnp.std(y), 1e-6)

  def normalized(self, x: jax.Array) -> jax.Array:
    """The MLP output in standardised label units. ``x [P, D]`` -> ``[P]``."""
    h = (x.astype(jnp.float32) - self.x_mean.value) / self.x_std.value
    act = ACTIVATIONS[self.activation]
    for layer in self.layers[:-1]:
      h = act(layer(h))
    return self.layers[-1](h)[..., 0]  # [P, 1] -> [P]

  def __call__(self, x: jax.Array) -> jax.Array:
    """log Z predictions. ``x [P, D]`` -> ``[P]`` float32."""
    return self.y_mean.value + self.y_std.value * self.normalized(x)
