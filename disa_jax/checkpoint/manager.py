"""Orbax checkpoints of a training run: array state plus JSON metadata, async, keep-last-k (plus one
protected step: the best by validation), resume.

A checkpoint at step s holds two items:

- ``state``: a pytree of arrays (policy params, optimizer state, the log Z head and its optimizer
  state when present, RNG key data, ...), saved with orbax's StandardSave and restored onto a
  caller-given target whose shapes, dtypes and shardings it takes.
- ``meta``: a JSON dict (data-iterator position, step, config digest, ...).

Saves are asynchronous: `save` returns once the arrays are copied off the devices and the write
proceeds in a background thread. Orbax writes into a temporary directory and renames it when the
write finishes, so a process killed mid-save (``kill -9``) leaves the previous checkpoint as the
latest one and the partial directory is ignored (and removed by the next manager on start).

A run rewound to an earlier checkpoint (Stage 3 recomputing metrics rows that were damaged,
`disa_jax.rl.trainer`) deletes the newer ones first (`discard_after`): it writes them again.

Retention: the last ``max_to_keep`` finished checkpoints are kept, plus the step a caller protects
(``save(..., keep_also=s)``: Stage 3 protects its best checkpoint by validation, the one the paper
reports). Older ones are deleted once a newer save has finished, never before, so a failed save
never leaves fewer than ``max_to_keep`` finished checkpoints.

Verified, not assumed: when a save finishes (orbax's post-finalization callback, in its background
thread for an asynchronous save) the size and CRC-32 of every file of the step are recorded in
``<step>/checksums.json`` (`disa_jax.checkpoint.verify`). A finished step whose files were damaged
afterwards (an array file truncated, deleted or with a flipped byte, a torn ``meta`` JSON, a missing
``state`` item: a copy cut short, a disk fault) is not used: `intact_steps` checks every step's
structure and file sizes (a stat per file), and `latest_step` reads the newest candidates' bytes
against their CRCs until one matches. It warns in one line naming the damaged steps and the step
it returns; when steps exist but none is usable it raises `CheckpointUnreadableError` naming the
directory (a command prints it as one ``error:`` line) rather than let a resumed run start over. A
step without checksums (saved before they existed, or by a process killed between orbax's rename
and the manifest) is checked for structure only; a restore that then fails raises
`CheckpointUnreadableError` naming the step instead of TensorStore's dump.

The directory may be a URL (``gs://``: orbax writes it through `etils.epath`; the removals and
checks here go through `disa_jax.paths`).

A save that fails (a full disk, a vanished directory, ...) raises `CheckpointSaveError` naming the
step, the directory, the cause (ENOSPC is spelled out) and the latest finished checkpoint, which is
intact. With asynchronous saves the error surfaces at the next `save`, `wait_until_finished` or
`close`.
"""
from __future__ import annotations

import errno
import os
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from disa_jax import paths
from disa_jax.checkpoint import verify
from disa_jax.checkpoint.verify import CheckpointUnreadableError

PyTree = Any


class CheckpointSaveError(RuntimeError):
  """A checkpoint could not be written; the checkpoints finished before it are intact."""

  def __init__(self, message: str, *, step: int | None, latest_step: int | None, disk_full: bool):
    super().__init__(message)
    self.step = step
    self.latest_step = latest_step
    self.disk_full = disk_full

  def __reduce__(self):  # (pickled back from a worker process with its arguments)
    return _save_error, (str(self), self.step, self.latest_step, self.disk_full)


def _save_error(message: str, step: int | None, latest_step: int | None, disk_full: bool
                ) -> CheckpointSaveError:
  return CheckpointSaveError(message, step=step, latest_step=latest_step, disk_full=disk_full)


def _is_disk_full(e: BaseException) -> bool:
  """Whether `e` (or an exception it was raised from) is ENOSPC."""
  while e is not None:
    if getattr(e, "errno", None) == errno.ENOSPC or "No space left on device" in str(e):
      return True
    e = e.__cause__ or e.__context__
  return False


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
  """Keeps the last ``max_to_keep`` checkpoints of a run (plus a protected one) under ``directory``.

  Args:
    directory: checkpoint root (created if missing; local or a URL); step s lives in
      ``directory/<s>``.
    max_to_keep: number of most recent checkpoints kept (>= 1), besides the protected step
      (``keep_also`` of the latest `save`).
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
    self.directory = paths.absolute(directory)
    paths.as_path(self.directory).mkdir(parents=True, exist_ok=True)
    self.max_to_keep, self._async = max_to_keep, async_save
    self._keep_also: int | None = None  # the protected step (beyond the last max_to_keep)
    options = ocp.CheckpointManagerOptions(
        max_to_keep=None,  # retention is `_prune`'s: the last max_to_keep plus the protected step
        save_interval_steps=save_interval_steps,
        enable_async_checkpointing=async_save,
        cleanup_tmp_directories=True,
        create=True,
        # (orbax calls it in its save thread, on the temporary directory before the rename)
        async_options=(ocp.AsyncOptions(post_finalization_callback=self._record_checksums)
                       if async_save else None),
    )
    self._mngr = ocp.CheckpointManager(self.directory, options=options,
                                       item_names=("state", "meta"))
    self._pending_step: int | None = None  # the step of the save in flight (or the last one)
    self._damage: dict[int, str | None] = {}  # step -> why it cannot be read (None: intact)
    self._verified: set[int] = set()  # steps whose every byte matched their checksums

  def _step_dir(self, step: int) -> str:
    return os.path.join(self.directory, str(step))

  def _record_checksums(self) -> None:
    """Once the save of ``self._pending_step`` is written: its checksums, by process 0. Orbax
    calls this for an asynchronous save before renaming the temporary directory into place, so the
    step appears with its checksums; a synchronous save calls it after."""
    if jax.process_index() != 0 or self._pending_step is None:
      return
    root = paths.as_path(self.directory)
    tmp = list(root.glob(f"{self._pending_step}.orbax-checkpoint-tmp*"))
    verify.write_manifest(str(tmp[0]) if len(tmp) == 1 else self._step_dir(self._pending_step))

  def _save_error(self, e: BaseException) -> CheckpointSaveError:
    """The `CheckpointSaveError` for a failure `e` of the save of `self._pending_step`."""
    try:
      self._mngr.reload()
      latest = self._mngr.latest_step()
    except Exception:  # pylint: disable=broad-except
      latest = None
    full = _is_disk_full(e)
    why = "the disk is full (ENOSPC: no space left on device)" if full else "the write failed"
    return CheckpointSaveError(
        f"checkpoint step {self._pending_step} could not be written under {self.directory}: {why}"
        f"{'; free space or choose another checkpoint directory' if full else ''}. The finished "
        f"checkpoints are intact; the latest is step {latest}. Cause: {type(e).__name__}: {e}",
        step=self._pending_step, latest_step=latest, disk_full=full)

  def _why_unreadable(self, step: int) -> str | None:
    """Why the finished checkpoint ``step`` cannot be restored (its structure, its files' sizes
    against its checksums, its meta), or None when it looks intact."""
    why = verify.check(self._step_dir(step), deep=False)
    if why is not None:
      return why
    state = paths.as_path(self.directory) / str(step) / "state" / "_METADATA"
    if not state.is_file():
      return f"its state item is incomplete ({state} is missing)"
    try:
      self._read_meta(step)
    except Exception as e:  # pylint: disable=broad-except
      return f"its meta cannot be read ({type(e).__name__}: {e})"
    return None

  def _why_not_verified(self, step: int) -> str | None:
    """Why ``step`` (intact by `_why_unreadable`) does not match its checksums byte for byte."""
    if step not in self._verified:
      why = verify.check(self._step_dir(step), deep=True)
      if why is not None:
        self._damage[step] = why
        return why
      self._verified.add(step)
    return None

  def intact_steps(self) -> list[int]:
    """The finished checkpoints whose structure and file sizes are intact, oldest first (the
    damaged ones are remembered: `latest_step` names them).

    Waits for a save in flight first (a step being written is not damaged).
    """
    self.wait_until_finished()
    out = []
    for step in sorted(self._mngr.all_steps()):
      if step not in self._damage:
        self._damage[step] = self._why_unreadable(step)
      if self._damage[step] is None:
        out.append(step)
    return out

  def _drop_damaged(self, step: int) -> None:
    """Removes the damaged checkpoints at or after ``step`` (a resumed run writes them again)."""
    self.intact_steps()
    doomed = [s for s, why in self._damage.items() if why is not None and s >= step]
    for s in doomed:
      paths.remove(os.path.join(self.directory, str(s)))
      del self._damage[s]
    if doomed:
      self._mngr.reload()

  def latest_step(self) -> int | None:
    """The newest finished checkpoint whose files match their checksums, or None when there is
    none. Damaged newer steps are skipped with one warning line naming them and the step returned.

    Raises:
      CheckpointUnreadableError: steps exist, but none of them can be read.
    """
    intact = self.intact_steps()
    newest = lambda: next((s for s in reversed(intact) if self._why_not_verified(s) is None), None)
    if jax.process_count() == 1:
      chosen = newest()
    else:  # process 0 reads the bytes (one read of the shared files); every process takes its step
      mine = newest() if jax.process_index() == 0 else None
      chosen = int(multihost_utils.broadcast_one_to_all(np.int32(-1 if mine is None else mine)))
      chosen = None if chosen < 0 else chosen
      self._verified.update({chosen} - {None})
      for s in intact:
        if chosen is None or s > chosen:
          self._damage[s] = self._damage.get(s) or "its files differ from their checksums"
    damaged = [(s, why) for s, why in sorted(self._damage.items())
               if why is not None and (chosen is None or s > chosen)]
    detail = "; ".join(f"step {s}: {why}" for s, why in damaged)
    if damaged and chosen is None:
      raise CheckpointUnreadableError(f"no usable checkpoint in {self.directory}: every step is "
                                      f"damaged ({detail}); move the directory aside to start over")
    if damaged and jax.process_index() == 0:
      several = len(damaged) > 1
      warnings.warn(f"checkpoint step{'s' * several} {', '.join(str(s) for s, _ in damaged)} in "
                    f"{self.directory} {'are' if several else 'is'} damaged and skipped ({detail}); "
                    f"resuming from step {chosen}", RuntimeWarning)
    return chosen

  def all_steps(self) -> list[int]:
    return sorted(self._mngr.all_steps())

  def discard_after(self, step: int) -> list[int]:
    """Deletes the finished checkpoints newer than ``step`` (a run rewound to ``step`` writes them
    again); returns their steps. Waits for a save in flight first."""
    self.intact_steps()  # (waits, and tells the damaged steps apart: orbax cannot read those)
    doomed = [s for s in self.all_steps() if s > step]
    for s in doomed:
      if self._damage.pop(s, None) is None:
        self._mngr.delete(s)
      else:
        paths.remove(os.path.join(self.directory, str(s)))
    if doomed:
      self._mngr.reload()
    if self._keep_also is not None and self._keep_also > step:
      self._keep_also = None
    return doomed

  def save(self, step: int, state: PyTree, meta: dict[str, Any], *, force: bool = False,
           keep_also: int | None = None) -> bool:
    """Starts saving ``state`` (arrays) and ``meta`` (JSON) at ``step``; True if a save started.

    Args:
      step, state, meta: what to save.
      force: save even when ``step`` is not a multiple of ``save_interval_steps``.
      keep_also: a step kept beyond the last ``max_to_keep`` (e.g. the best by validation) from
        now on; None keeps the step protected before.

    Raises:
      CheckpointSaveError: this save, or the previous asynchronous one, could not be written.
    """
    if step < 0:
      raise ValueError(f"checkpoint step must be >= 0, got {step!r}")
    self._drop_damaged(step)
    self._verified.discard(step)  # (a step written again is checked again)
    if not (force or self._mngr.should_save(step)):
      return False
    if keep_also is not None:
      self._keep_also = int(keep_also)
    self.wait_until_finished()  # a failed previous save is reported as itself, not as this one
    self._pending_step = step
    try:
      started = self._mngr.save(
          step,
          args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                  meta=ocp.args.JsonSave(dict(meta))),
          force=force)
    except Exception as e:  # pylint: disable=broad-except
      raise self._save_error(e) from e
    if not self._async:
      if started:
        self._record_checksums()
      self._prune()
    return started

  def _prune(self) -> None:
    """Deletes the finished checkpoints that are neither among the last ``max_to_keep`` nor the
    protected step."""
    steps = self.all_steps()
    keep = set(steps[-self.max_to_keep:]) | {self._keep_also}
    for s in steps:
      if s not in keep:
        self._mngr.delete(s)

  def restore(self, target: PyTree, step: int | None = None) -> tuple[int, PyTree, dict[str, Any]]:
    """Restores the checkpoint at ``step`` (default: the latest) onto ``target``'s structure.

    Args:
      target: a pytree with the structure of the saved state; its leaves give shapes, dtypes and
        (for jax.Arrays) the shardings to restore onto.
      step: the step to restore; None for the latest.

    Returns:
      (step, state, meta).

    Raises:
      CheckpointUnreadableError: the step's files differ from their checksums, or do not read.
    """
    if step is None:
      step = self.latest_step()
      if step is None:
        raise FileNotFoundError(f"no finished checkpoint under {self.directory}")
    why = self._why_not_verified(step)
    if why is None:
      try:
        out = self._mngr.restore(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardRestore(_abstract(target)),
                                    meta=ocp.args.JsonRestore()))
        return step, out["state"], dict(out["meta"])
      except Exception as e:  # pylint: disable=broad-except  (TensorStore's many-line errors)
        why = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"
    raise CheckpointUnreadableError(
        f"checkpoint step {step} in {self._step_dir(step)} cannot be restored ({why}); if its files "
        f"are damaged, move it aside to resume from an earlier step")

  def read_meta(self, step: int | None = None) -> dict[str, Any]:
    """The JSON metadata of the checkpoint at ``step`` (default: the latest), without its arrays.

    Lets a caller compare what a checkpoint was written with before restoring it onto a target.
    """
    if step is None:
      step = self.latest_step()
      if step is None:
        raise FileNotFoundError(f"no finished checkpoint under {self.directory}")
    return self._read_meta(step)

  def _read_meta(self, step: int) -> dict[str, Any]:
    out = self._mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
    return dict(out["meta"])

  def wait_until_finished(self) -> None:
    """Blocks until any background save has been written.

    Raises:
      CheckpointSaveError: the background save could not be written.
    """
    try:
      self._mngr.wait_until_finished()
    except Exception as e:  # pylint: disable=broad-except
      raise self._save_error(e) from e
    self._prune()

  def close(self) -> None:
    """Waits for the background save, then closes (raising `CheckpointSaveError` if it failed)."""
    try:
      self.wait_until_finished()
    finally:
      self._mngr.close()

  def __enter__(self) -> "CheckpointManager":
    return self

  def __exit__(self, *exc) -> None:
    self.close()
