"""The identity of a resumable stage's inputs, recorded beside its output and checked on a rerun.

A stage (Stage 1 dataset, Stage 2 anchor, Stage 3 run, SFT export, one evaluated benchmark) builds
a flat ``{field: JSON value}`` identity: every input path with the sha256 of its content
(`fingerprint`; a directory hashes every file's relative path and bytes) plus the config fields
that change its results. `claim_output` writes it to ``<output>/<name>`` before the stage writes
anything else, and on a rerun

- resumes when the stored identity equals this run's (the same work, finished or not);
- raises `IdentityMismatchError` naming every differing field with its old and new value;
- with ``overwrite=True``, calls the stage's ``discard`` (removes its outputs) and starts afresh.

An identity that differs while the stage has no outputs yet (a first run that stopped early) is
simply replaced.

Outputs found without an identity file (written before identities existed, or by hand) count as a
mismatch: nothing says what they were computed from. Hashing streams the files (about 1 GB/s on one
core; a 8 GB checkpoint costs seconds). Hidden files (a writer's ``.lock``) and ``*.tmp`` files
left by a killed writer are not part of a directory's fingerprint.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

_CHUNK = 1 << 20


class IdentityMismatchError(ValueError):
  """An output was computed from other inputs; ``diffs`` maps field -> (old, new)."""

  def __init__(self, where: Path, diffs: dict[str, tuple[Any, Any]]):
    self.where, self.diffs = where, diffs
    lines = "\n".join(f"  {k}: stored {o!r}, this run {n!r}" for k, (o, n) in sorted(diffs.items()))
    super().__init__(f"{where.parent} holds outputs of a run with other inputs ({len(diffs)} "
                     f"field(s) differ, recorded in {where}):\n{lines}\nUse a new output "
                     f"directory, the same inputs, or overwrite=True to discard the old outputs.")

  def __reduce__(self):  # (pickled back from a worker process with its arguments)
    return type(self), (self.where, self.diffs)


def _hash_file(path: Path, h) -> None:
  with open(path, "rb") as f:
    while chunk := f.read(_CHUNK):
      h.update(chunk)


def _skipped(name: str) -> bool:
  return name.startswith(".") or name.endswith(".tmp")


def fingerprint(path: str | os.PathLike) -> str:
  """sha256 of a file's bytes, or of a directory's (relative path, bytes) pairs in sorted order.

  Raises:
    FileNotFoundError: the path does not exist.
  """
  path = Path(path)
  if not path.exists():
    raise FileNotFoundError(f"cannot fingerprint {path}: it does not exist")
  h = hashlib.sha256()
  if path.is_file():
    _hash_file(path, h)
    return h.hexdigest()
  files = []
  for root, dirs, names in os.walk(path):
    dirs[:] = sorted(d for d in dirs if not _skipped(d))
    files += [Path(root) / n for n in names if not _skipped(n)]
  for f in sorted(files, key=lambda p: p.relative_to(path).as_posix()):
    rel = f.relative_to(path).as_posix().encode()
    h.update(len(rel).to_bytes(8, "little") + rel + f.stat().st_size.to_bytes(8, "little"))
    _hash_file(f, h)
  return h.hexdigest()


def inputs(**paths: str) -> dict[str, str]:
  """``{name: path, name + '.sha256': fingerprint}`` for every non-empty path."""
  out = {}
  for name, p in paths.items():
    if p:
      out[name] = str(p)
      out[f"{name}.sha256"] = fingerprint(p)
  return out


def _normalised(identity: Mapping[str, Any]) -> dict[str, Any]:
  """What JSON gives back (tuples as lists, ...), so stored and fresh identities compare equal."""
  return json.loads(json.dumps(dict(identity), sort_keys=True))


def remove_paths(paths: Iterable[str | os.PathLike]) -> None:
  """Deletes each path, a file or a directory tree; one that is not there is skipped (the
  ``discard`` of `claim_output` for a stage whose outputs are these paths)."""
  for p in map(Path, paths):
    if p.is_dir() and not p.is_symlink():
      shutil.rmtree(p)
    else:
      p.unlink(missing_ok=True)


def claim_output(path: str | os.PathLike, identity: Mapping[str, Any], *, overwrite: bool,
                 has_output: bool, discard: Callable[[], None]) -> str:
  """Records ``identity`` at ``path`` or checks it against the one recorded there.

  Args:
    path: the identity file (beside the output it describes).
    identity: flat ``{field: JSON-serialisable value}``.
    overwrite: discard outputs of other inputs instead of refusing.
    has_output: whether the stage's outputs exist already (without an identity they are refused;
      without outputs a differing identity is replaced).
    discard: removes the stage's outputs (called before the new identity is written).

  Returns:
    'new' (nothing was there), 'resumed' (same identity) or 'overwritten'.

  Raises:
    IdentityMismatchError: another identity (or none, with outputs present) and not ``overwrite``.
  """
  path = Path(path)
  new = _normalised(identity)
  if path.exists():
    old = json.loads(path.read_text())
    if old == new:
      return "resumed"
    diffs = {k: (old.get(k), new.get(k)) for k in sorted(set(old) | set(new))
             if old.get(k) != new.get(k)} if has_output else {}
  elif has_output:
    diffs = {"(identity)": (None, f"outputs exist but {path.name} is missing")}
  else:
    diffs = {}
  state = "new"
  if diffs:
    if not overwrite:
      raise IdentityMismatchError(path, diffs)
    discard()
    state = "overwritten"
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_name(path.name + ".tmp")
  tmp.write_text(json.dumps(new, indent=1, sort_keys=True))
  os.replace(tmp, path)
  return state
