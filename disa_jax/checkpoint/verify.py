"""Checksums of a finished checkpoint step: what it held when its save finished, checked on resume.

Orbax renames a step into place only once it is written, so a step directory is complete when it
appears; but a copy cut short, a disk fault or an edit afterwards damages it without a sign until
TensorStore fails mid-restore. When a save finishes, `write_manifest` records the size and CRC-32 of
every file of the step in ``<step>/checksums.json`` (written through a temporary name, last);
`check` compares them: ``deep=False`` sizes only (a stat per file: a truncated or missing file),
``deep=True`` the CRC too (every byte read once: a flipped byte). A step without a manifest (saved
before manifests existed, or by a process killed between the rename and the manifest) is not
verifiable here; the caller decides (`disa_jax.checkpoint.manager`: its arrays are read instead).

CRC-32 detects accidental damage (it is not a signature). zlib releases the GIL while it hashes,
so the manifest of an asynchronous save is written in orbax's background thread without stalling
training.
"""
from __future__ import annotations

import json
import os
import zlib

from disa_jax import paths

MANIFEST = "checksums.json"
_CHUNK = 16 << 20


class CheckpointUnreadableError(RuntimeError):
  """No finished checkpoint of a directory can be read, or the one asked for cannot."""


def _files(step_dir: str) -> list[str]:
  """The files of the step's items (paths relative to ``step_dir``, '/'-separated, sorted): what
  a restore reads. (Orbax rewrites the step's own ``_CHECKPOINT_METADATA`` after the rename.)"""
  out = []
  for root, _, names in paths.walk(step_dir):
    rel = os.path.relpath(str(root), str(step_dir)) if not paths.is_remote(step_dir) else \
        str(root)[len(str(step_dir)):].strip("/")
    for n in names:
      path = n if rel in ("", ".") else f"{rel}/{n}"
      if "/" in path and not path.endswith(".tmp"):
        out.append(path.replace(os.sep, "/"))
  return sorted(out)


def _crc(path: paths.AnyPath) -> int:
  crc = 0
  with path.open("rb") as f:
    while chunk := f.read(_CHUNK):
      crc = zlib.crc32(chunk, crc)
  return crc


def write_manifest(step_dir: str) -> None:
  """Records every file of the finished step ``step_dir``: {relative path: [bytes, CRC-32]}."""
  root = paths.as_path(step_dir)
  files = {rel: [(root / rel).stat().st_size, _crc(root / rel)] for rel in _files(step_dir)}
  tmp = root / (MANIFEST + ".tmp")
  tmp.write_text(json.dumps({"format": 1, "files": files}))
  paths.replace(tmp, root / MANIFEST)


def has_manifest(step_dir: str) -> bool:
  return (paths.as_path(step_dir) / MANIFEST).is_file()


def check(step_dir: str, *, deep: bool) -> str | None:
  """Why the step ``step_dir`` differs from its manifest (the first file that does), or None when
  it matches (or has no manifest: `has_manifest`). ``deep`` reads every byte (CRC-32)."""
  root = paths.as_path(step_dir)
  try:
    recorded = json.loads((root / MANIFEST).read_text())["files"]
  except FileNotFoundError:
    return None
  except (OSError, ValueError, KeyError, TypeError) as e:
    return f"its {MANIFEST} cannot be read ({type(e).__name__}: {e})"
  for rel, (size, crc) in sorted(recorded.items()):
    path = root / rel
    try:
      now = path.stat().st_size
    except FileNotFoundError:
      return f"{rel} is missing"
    if now != size:
      return f"{rel} holds {now} bytes, {size} when saved"
    if deep and _crc(path) != crc:
      return f"{rel} differs from what was saved (CRC-32 mismatch)"
  return None
