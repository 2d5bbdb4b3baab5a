"""Orbax checkpoints of a training run: array state plus JSON metadata, async, keep-last-k, resume.

A checkpoint at step s holds two items:

- ``state``: a pytree of arrays (policy params, optimizer state, the log Z head and its optimizer
  state when present, RNG key data, ...), saved with orbax's StandardSave and restored onto a
  caller-given target whose shapes, dtypes and shardings it takes.
- ``meta``: a JSON dict (data-iterator position, step, config digest, ...).

Saves are asynchronous: `save` returns once the arrays are copied off the devices and the write
proceeds in a background thread. Orbax writes into a temporary directory and renames it when the
write finishes, so a process killed mid-save (``kill -9``) leaves the previous checkpoint as the
latest one and the partial directory is ignored (and removed by the next manager on start).
"""
from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

PyTree = Any


def rng_to_array(key: jax.Array) -> jax.Array:
  """A typed PRNG key -> its uint32 key data (checkpointable)."""
  return jax.random.key_data(key)


def array_to_rng(data: jax.Array) -> jax.Array:
  """uint32 key data -> typed PRNG key (inverse of `rng_to_array`)."""
  return jax.random.wrap_key_data(jnp.asarray(data, jnp.uint32))


def _abstract(target: PyTree) -> PyTree:
  """Shape/dtype/sharding structs for a pytree of arrays."""

  def one(x):
    if isinstance(x, jax.Array):
      return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    x = np.asarray(x)
    return jax.ShapeDtypeStruct(x.shape, x.dtype)

  return jax.tree.map(one, target)


class CheckpointManager:
  """Keeps the last ``max_to_keep`` checkpoints of a run under ``directory``.

  Args:
    directory: checkpoint root (created if missing); step s lives in ``directory/<s>``.
    max_to_keep: number of most recent checkpoints kept (>= 1).
    save_interval_steps: `save` writes only on multiples of this (unless ``force``).
    async_save: write in a background thread (True) or block in `save` (False).
  """

  def __init__(self,
               directory: str | os.PathLike,
               *,
               max_to_keep: int = 3,
               save_interval_steps: int = 1,
               async_save: bool = True):
    if max_to_keep < 1:
      raise ValueError(f"checkpoint max_to_keep must be >= 1, got {max_to_keep!r}")
    if save_interval_steps < 1:
      raise ValueError(f"checkpoint save_interval_steps must be >= 1, got {save_interval_steps!r}")
    self.directory = os.path.abspath(os.fspath(directory))
    os.makedirs(self.directory, exist_ok=True)
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep,
        save_interval_steps=save_interval_steps,
        enable_async_checkpointing=async_save,
        cleanup_tmp_directories=True,
        create=True,
    )
    self._mngr = ocp.CheckpointManager(self.directory, options=options,
                                       item_names=("state", "meta"))

  def latest_step(self) -> int | None:
    """The newest finished checkpoint's step, or None."""
    return self._mngr.latest_step()

  def all_steps(self) -> list[int]:
    return sorted(self._mngr.all_steps())

  def save(self, step: int, state: PyTree, meta: dict[str, Any], *, force: bool = False) -> bool:
    """Starts saving ``state`` (arrays) and ``meta`` (JSON) at ``step``; True if a save started."""
    if step < 0:
      raise ValueError(f"checkpoint step must be >= 0, got {step!r}")
    return self._mngr.save(
        step,
        args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                meta=ocp.args.JsonSave(dict(meta))),
        force=force)

  def restore(self, target: PyTree, step: int | None = None) -> tuple[int, PyTree, dict[str, Any]]:
    """Restores the checkpoint at ``step`` (default: the latest) onto ``target``'s structure.

    Args:
      target: a pytree with the structure of the saved state; its leaves give shapes, dtypes and
        (for jax.Arrays) the shardings to restore onto.
      step: the step to restore; None for the latest.

    Returns:
      (step, state, meta).
    """
    if step is None:
      step = self.latest_step()
      if step is None:
        raise FileNotFoundError(f"no finished checkpoint under {self.directory}")
    out = self._mngr.restore(
        step,
        args=ocp.args.Composite(state=ocp.args.StandardRestore(_abstract(target)),
                                meta=ocp.args.JsonRestore()))
    return step, out["state"], dict(out["meta"])

  def read_meta(self, step: int | None = None) -> dict[str, Any]:
    """The JSON metadata of the checkpoint at ``step`` (default: the latest), without its arrays.

    Lets a caller compare what a checkpoint was written with before restoring it onto a target.
    """
    if step is None:
      step = self.latest_step()
      if step is None:
        raise FileNotFoundError(f"no finished checkpoint under {self.directory}")
    out = self._mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
    return dict(out["meta"])

  def wait_until_finished(self) -> None:
    """Blocks until any background save has been written."""
    self._mngr.wait_until_finished()

  def close(self) -> None:
    self._mngr.wait_until_finished()
    self._mngr.close()

  def __enter__(self) -> "CheckpointManager":
    return self

  def __exit__(self, *exc) -> None:
    self.close()
