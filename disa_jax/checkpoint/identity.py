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

A stage whose identity gained fields (Stage 3's training settings) passes ``recorded``: for an
identity file written before, it supplies the stored output's values of the fields the file lacks
(Stage 3 reads them from its latest checkpoint's metadata); when they agree the run resumes and the
file is rewritten with every field, else the mismatch names them. `flatten` spells a nested section
field by field (``train.optim.lr``), so that a mismatch names the field, not the section.

Inputs are compared by content, not by location: a field ``X`` with a fingerprint ``X.sha256``
beside it (`inputs`) is compared by the fingerprint alone, and a path-named entry of a config
section (a key ending in ``path`` or ``paths``) that names such an input reads ``<X>`` in the
comparison. A run directory copied elsewhere (other absolute paths, the same bytes) therefore
resumes, and its identity file is rewritten to name the inputs where they are now; another model
under the same path is refused (its fingerprint differs). Identity files written before this rule
hold the same fields and resume the same way. Fields a stage names in ``locations`` (where an
output goes, e.g. Stage 2's ``anchor_path``) are recorded and never compared: the outputs are
found there or made again. Paths may be URLs (``gs://``, `disa_jax.paths`).

Outputs found without an identity file (written before identities existed, or by hand) count as a
mismatch: nothing says what they were computed from. Hashing streams the files (about 1 GB/s on one
core; a 8 GB checkpoint costs seconds). Hidden files (a writer's ``.lock``) and ``*.tmp`` files
left by a killed writer are not part of a directory's fingerprint.
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Callable, Iterable, Mapping

from disa_jax import paths
from disa_jax.checkpoint.files import naming

_CHUNK = 1 << 20


class IdentityMismatchError(ValueError):
  """An output was computed from other inputs; ``diffs`` maps field -> (old, new)."""

  def __init__(self, where: paths.AnyPath, diffs: dict[str, tuple[Any, Any]]):
    self.where, self.diffs = where, diffs
    lines = "\n".join(f"  {k}: stored {o!r}, this run {n!r}" for k, (o, n) in sorted(diffs.items()))
    super().__init__(f"{where.parent} holds outputs of a run with other inputs ({len(diffs)} "
                     f"field(s) differ, recorded in {where}):\n{lines}\nUse a new output "
                     f"directory, the same inputs, or overwrite=True to discard the old outputs.")

  def __reduce__(self):  # (pickled back from a worker process with its arguments)
    return type(self), (self.where, self.diffs)


def _hash_file(path: paths.AnyPath, h) -> None:
  with path.open("rb") as f:
    while chunk := f.read(_CHUNK):
      h.update(chunk)


def _skipped(name: str) -> bool:
  return name.startswith(".") or name.endswith(".tmp")


def fingerprint(path: str | os.PathLike) -> str:
  """sha256 of a file's bytes, or of a directory's (relative path, bytes) pairs in sorted order
  (local or a URL: the same bytes give the same fingerprint).

  Raises:
    FileNotFoundError: the path does not exist.
  """
  path = paths.as_path(path)
  if not path.exists():
    raise FileNotFoundError(f"cannot fingerprint {path}: it does not exist")
  h = hashlib.sha256()
  if path.is_file():
    _hash_file(path, h)
    return h.hexdigest()
  files = []
  for root, dirs, names in paths.walk(path):
    dirs[:] = sorted(d for d in dirs if not _skipped(d))
    files += [root / n for n in names if not _skipped(n)]
  for f in sorted(files, key=lambda p: p.relative_to(path).as_posix()):
    rel = f.relative_to(path).as_posix().encode()
    h.update(len(rel).to_bytes(8, "little") + rel + f.stat().st_size.to_bytes(8, "little"))
    _hash_file(f, h)
  return h.hexdigest()


def flatten(prefix: str, tree: Mapping[str, Any]) -> dict[str, Any]:
  """``{'<prefix>.<key>[.<key>...]': leaf}`` for every leaf of a nested mapping (lists are leaves).

  E.g. ``flatten('train', {'optim': {'lr': 1e-6}, 'seed': 0})`` is ``{'train.optim.lr': 1e-6,
  'train.seed': 0}``.
  """
  out = {}
  for key, value in tree.items():
    name = f"{prefix}.{key}"
    out.update(flatten(name, value) if isinstance(value, Mapping) else {name: value})
  return out


def inputs(**named: str) -> dict[str, str]:
  """``{name: path, name + '.sha256': fingerprint}`` for every non-empty path (the path is where
  the input is now; the fingerprint is what is compared)."""
  out = {}
  for name, p in named.items():
    if p:
      out[name] = str(p)
      out[f"{name}.sha256"] = fingerprint(p)
  return out


def added_inputs(identity: Mapping[str, Any], missing: Iterable[str], prefix: str
                 ) -> dict[str, Any]:
  """For `claim_output`'s ``recorded``: the fields of ``identity`` named ``prefix...`` that an older
  identity file lacks (``missing``): inputs fingerprinted since it was written, taken as they are
  now. The older file's config section still names them by path, so they resume only where that
  path is the same."""
  return {k: identity[k] for k in missing if k.startswith(prefix) and k in identity}


def _normalised(identity: Mapping[str, Any]) -> dict[str, Any]:
  """What JSON gives back (tuples as lists, ...), so stored and fresh identities compare equal."""
  return json.loads(json.dumps(dict(identity), sort_keys=True))


def _comparable(identity: Mapping[str, Any], locations: Iterable[str]) -> dict[str, Any]:
  """What an identity is compared on (the module docstring): without its inputs' paths and its
  ``locations``, each path-named config entry that names an input read as ``<input>``."""
  located = sorted(k for k in identity if f"{k}.sha256" in identity)
  names = {identity[k]: f"<{k}>" for k in reversed(located) if isinstance(identity[k], str)}

  def view(key: str, value: Any) -> Any:
    if isinstance(value, Mapping):
      return {k: view(k, v) for k, v in value.items()}
    if isinstance(value, list):
      return [view(key, v) for v in value]
    if isinstance(value, str) and key.endswith(("path", "paths")):
      return names.get(value, value)
    return value

  dropped = set(located) | set(locations)
  return {k: view(k, v) for k, v in identity.items() if k not in dropped}


def remove_paths(outputs: Iterable[str | os.PathLike]) -> None:
  """Deletes each path, a file or a directory tree (local or a URL); one that is not there is
  skipped (the ``discard`` of `claim_output` for a stage whose outputs are these paths)."""
  for p in outputs:
    paths.remove(p)


def _read_stored(path: paths.AnyPath, replaceable: bool) -> dict[str, Any]:
  """The identity stored at ``path``; an unreadable one is {} (it differs from any identity) when
  ``replaceable``, else an error naming the file."""
  try:
    stored = json.loads(path.read_text())
    if not isinstance(stored, dict):
      raise ValueError(f"it holds a {type(stored).__name__}, not an object")
  except (OSError, ValueError) as e:
    if replaceable:
      return {}
    raise ValueError(f"{path}: unreadable identity file ({e}); restore it, or pass overwrite=True "
                     "to discard the outputs beside it") from None
  return stored


def claim_output(path: str | os.PathLike, identity: Mapping[str, Any], *, overwrite: bool,
                 has_output: bool, discard: Callable[[], None],
                 recorded: Callable[[list[str]], Mapping[str, Any]] | None = None,
                 locations: Iterable[str] = ()) -> str:
  """Records ``identity`` at ``path`` or checks it against the one recorded there.

  Args:
    path: the identity file (beside the output it describes).
    identity: flat ``{field: JSON-serialisable value}``.
    overwrite: discard outputs of other inputs instead of refusing.
    has_output: whether the stage's outputs exist already (without an identity they are refused;
      without outputs a differing identity is replaced).
    discard: removes the stage's outputs (called before the new identity is written).
    recorded: for an identity file written before some of ``identity``'s fields existed: called
      with the fields it lacks, returns the values the outputs were computed with; a field it does
      not return counts as differing (stored None). None: a lacking field differs.
    locations: fields naming where an output goes: recorded, not compared.

  Returns:
    'new' (nothing was there), 'resumed' (same identity; a file lacking fields that ``recorded``
    supplied equal, or naming inputs elsewhere, is rewritten as this run's) or 'overwritten'.

  Raises:
    IdentityMismatchError: another identity (or none, with outputs present) and not ``overwrite``.
    ValueError: the identity file cannot be read while outputs exist and ``overwrite`` is off
      (it names the file).
    OutputWriteError: the identity file cannot be written (it names the file).
  """
  path, locations = paths.as_path(path), tuple(locations)
  new = _normalised(identity)
  if path.exists():
    old = stored = _read_stored(path, replaceable=overwrite or not has_output)
    missing = sorted(set(new) - set(stored))
    if missing and recorded is not None and has_output:
      found = _normalised({k: v for k, v in recorded(missing).items() if k in missing})
      old = {**found, **stored}
    if old == new and stored == new:
      return "resumed"
    before, now = _comparable(old, locations), _comparable(new, locations)
    diffs = {k: (old.get(k), new.get(k)) for k in sorted(set(before) | set(now))
             if before.get(k) != now.get(k)} if has_output else {}
    if not diffs and has_output:  # lacking fields equal, or inputs moved: rewritten as this run's
      _write(path, new)
      return "resumed"
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
  _write(path, new)
  return state


def _write(path: paths.AnyPath, identity: Mapping[str, Any]) -> None:
  tmp = path.with_name(path.name + ".tmp")
  with naming(tmp, "the identity file"):
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp.write_text(json.dumps(identity, indent=1, sort_keys=True))
    paths.replace(tmp, path)
