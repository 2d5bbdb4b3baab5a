"""One place for paths: a local file or directory, or a remote one named by a URL.

`as_path(p)` is a `pathlib.Path` for a local path, so local files behave exactly as before (the
same calls, the same bytes), and a `RemotePath` for a URL ``<scheme>://...`` of any fsspec file
system (``gs://`` through gcsfs, ``s3://`` through s3fs, ``memory://`` built in): the pathlib
methods this code uses (``/``, ``name``, ``parent``, ``exists``, ``is_file``, ``is_dir``,
``iterdir``, ``glob``, ``mkdir``, ``open``, ``read_*`` / ``write_*``, ``unlink``, ``stat``),
served by fsspec. `etils.epath` (what orbax reads ``gs://`` checkpoints with) is not used: it knows
a fixed set of schemes, ``memory://`` not among them, and without TensorFlow it serves ``gs://``
through fsspec and gcsfs as well. A scheme whose fsspec package is missing (gcsfs is not installed
by default) fails on first use with a ValueError naming the URL and fsspec's message naming the
package (``Please install gcsfs to access Google Storage``).

What pathlib lacks, or what differs on an object store, is a function here, one call for both:

- `replace`: ``os.replace`` locally (atomic: the temporary file + rename of every writer here);
  remotely a server-side copy then a delete of the source. What still holds on an object store:
  an object is written whole or not at all (it appears when its writer closes it, and a copy
  makes the new object in one step), so a reader of the target sees the old object or the new
  one, never a part. What does not: the two steps are not one, so a crash between them leaves the
  temporary beside a complete target (the next write replaces it; a directory's `fingerprint`
  and the Stage 1 reader skip ``*.tmp``), and a listing may show both for a moment.
- `link_new`: ``os.link`` locally (fails rather than replace a file); remotely a copy after an
  existence check, so two writers on different machines could race for one name.
- `append`: locally an append that is flushed and fsync'ed; an object cannot be appended to, so
  remotely the object is rewritten with the new text (whole: the old object or the new one).
- `sync`: ``fsync`` of a written local file; an object is durable once closed.
- `truncate`, `walk`, `remove`, `staged_dir`, `local_copy` (for writers that need local files:
  orbax writes a remote anchor's weights into a local directory that is then uploaded).
- `lock_file`: object stores have no locks; a remote output's lock is a local file named after
  its URL (`disa_jax.checkpoint.lock`), so it excludes the writers of this machine only.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import posixpath
import re
import shutil
import tempfile
import types
from pathlib import Path, PurePosixPath
from typing import IO, Any, Iterator

import fsspec

_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://(.*)$")


def is_remote(path: Any) -> bool:
  """Whether ``path`` is a URL (``gs://b/x``, a `RemotePath`), not a local path."""
  return isinstance(path, RemotePath) or (isinstance(path, str) and bool(_URL.match(path)))


def as_path(path: str | os.PathLike) -> "AnyPath":
  """A `pathlib.Path` for a local path, a `RemotePath` for a URL (either passes unchanged)."""
  if isinstance(path, (Path, RemotePath)):
    return path
  return RemotePath(path) if is_remote(path) else Path(path)


class RemotePath:
  """A path on an fsspec file system, ``<scheme>://<key>`` (the ``/``-separated key normalised:
  no trailing or repeated ``/``), with the pathlib methods this code uses. It has no
  ``__fspath__``: a local-only call (``os.open``, ``shutil``) given one fails at once instead of
  writing a local file named after the URL."""

  def __init__(self, url: str):
    m = _URL.match(str(url))
    if m is None:
      raise ValueError(f"not a URL (<scheme>://...): {url!r}")
    key = posixpath.normpath(m.group(2)).lstrip("/") if m.group(2).strip("/") else ""
    self.scheme, self.key = m.group(1), key
    self.url = f"{self.scheme}://{key}"

  @property
  def fs(self) -> fsspec.AbstractFileSystem:
    """The scheme's file system (fsspec caches one per scheme and options).

    Raises:
      ValueError: the scheme is unknown, or its fsspec package is not installed (both named).
    """
    try:
      return fsspec.filesystem(self.scheme)
    except (ImportError, ValueError) as e:
      raise ValueError(f"{self.url}: cannot open {self.scheme}:// paths here ({e})") from None

  def __str__(self) -> str:
    return self.url

  def __repr__(self) -> str:
    return f"RemotePath({self.url!r})"

  def __eq__(self, other: object) -> bool:
    return isinstance(other, RemotePath) and other.url == self.url

  def __lt__(self, other: "RemotePath") -> bool:
    return self.url < other.url

  def __hash__(self) -> int:
    return hash(self.url)

  def __truediv__(self, part: str | os.PathLike) -> "RemotePath":
    return RemotePath(f"{self.url}/{os.fspath(part)}")

  @property
  def name(self) -> str:
    return posixpath.basename(self.key)

  @property
  def suffix(self) -> str:
    return PurePosixPath(self.name).suffix

  @property
  def parent(self) -> "RemotePath":
    return RemotePath(f"{self.scheme}://{posixpath.dirname(self.key)}")

  @property
  def parents(self) -> list["RemotePath"]:
    """The ancestors, nearest first, down to ``<scheme>://``."""
    out = [self.parent] if self.key else []
    while out and out[-1].key:
      out.append(out[-1].parent)
    return out

  def with_name(self, name: str) -> "RemotePath":
    return self.parent / name

  def with_suffix(self, suffix: str) -> "RemotePath":
    return self.with_name(PurePosixPath(self.name).with_suffix(suffix).name)

  def relative_to(self, other: "RemotePath") -> PurePosixPath:
    return PurePosixPath(self.key).relative_to(other.key)

  def resolve(self) -> "RemotePath":
    return self  # a URL is absolute, and there are no links to follow

  absolute = expanduser = resolve

  def exists(self) -> bool:
    return self.fs.exists(self.url)

  def is_file(self) -> bool:
    return self.fs.isfile(self.url)

  def is_dir(self) -> bool:
    return self.fs.isdir(self.url)

  def stat(self) -> types.SimpleNamespace:
    """``st_size`` (bytes) of the object."""
    return types.SimpleNamespace(st_size=int(self.fs.size(self.url)))

  def iterdir(self) -> Iterator["RemotePath"]:
    for entry in self.fs.ls(self.url, detail=False):
      name = posixpath.basename(entry.rstrip("/"))
      if name:
        yield self / name

  def glob(self, pattern: str) -> Iterator["RemotePath"]:
    """The entries of this directory whose names match ``pattern`` (one level, as used here)."""
    for entry in self.fs.glob(f"{self.url}/{pattern}"):
      yield self / posixpath.basename(entry.rstrip("/"))

  def mkdir(self, mode: int = 0o777, parents: bool = False, exist_ok: bool = False) -> None:
    """A directory (fsspec's ``makedirs``: in memory a directory entry; under an existing
    bucket nothing, an object store's directories being prefixes)."""
    del mode, parents
    if not exist_ok and self.exists():
      raise FileExistsError(errno.EEXIST, "File exists", self.url)
    self.fs.makedirs(self.url, exist_ok=True)

  def open(self, mode: str = "r", buffering: int = -1, encoding: str | None = None,
           errors: str | None = None, newline: str | None = None) -> IO[Any]:
    del buffering
    text = {} if "b" in mode else dict(encoding=encoding, errors=errors, newline=newline)
    return self.fs.open(self.url, mode, **text)

  def read_bytes(self) -> bytes:
    with self.open("rb") as f:
      return f.read()

  def read_text(self, encoding: str | None = None) -> str:
    with self.open("r", encoding=encoding) as f:
      return f.read()

  def write_bytes(self, data: bytes) -> int:
    with self.open("wb") as f:
      return f.write(data)

  def write_text(self, data: str, encoding: str | None = None) -> int:
    with self.open("w", encoding=encoding) as f:
      return f.write(data)

  def unlink(self, missing_ok: bool = False) -> None:
    if not self.exists():
      if missing_ok:
        return
      raise FileNotFoundError(errno.ENOENT, "No such file or directory", self.url)
    self.fs.rm_file(self.url)


AnyPath = Path | RemotePath  # what `as_path` returns


def absolute(path: str | os.PathLike) -> str:
  """``os.path.abspath`` of a local path; a URL as `RemotePath` normalises it."""
  return str(RemotePath(path)) if is_remote(path) else os.path.abspath(os.fspath(path))


def replace(src: str | os.PathLike, dst: str | os.PathLike) -> None:
  """Moves ``src`` over ``dst``: ``os.replace`` locally, a copy and a delete remotely."""
  src, dst = as_path(src), as_path(dst)
  if is_remote(src) or is_remote(dst):
    _same_file_system(src, dst).fs.mv(str(src), str(dst))
  else:
    os.replace(src, dst)


def link_new(src: str | os.PathLike, dst: str | os.PathLike) -> None:
  """``dst`` as a second name of ``src`` (remotely: a copy); FileExistsError if ``dst`` exists."""
  src, dst = as_path(src), as_path(dst)
  if not (is_remote(src) or is_remote(dst)):
    os.link(src, dst)
  elif dst.exists():
    raise FileExistsError(errno.EEXIST, "File exists", str(dst))
  else:
    _same_file_system(src, dst).fs.copy(str(src), str(dst))


def _same_file_system(src, dst) -> RemotePath:
  if not (isinstance(src, RemotePath) and isinstance(dst, RemotePath)
          and src.scheme == dst.scheme):
    raise ValueError(f"cannot move {src} to {dst}: not on one file system")
  return src


def append(path: str | os.PathLike, text: str) -> None:
  """Appends UTF-8 ``text`` durably (see the module docstring for an object store)."""
  p = as_path(path)
  if is_remote(p):
    p.write_bytes((p.read_bytes() if p.exists() else b"") + text.encode("utf-8"))
    return
  with open(p, "a", encoding="utf-8") as f:
    f.write(text)
    f.flush()
    os.fsync(f.fileno())


def sync(path: str | os.PathLike) -> None:
  """Forces a written local file to disk (an object is durable once its writer closed it)."""
  p = as_path(path)
  if not is_remote(p):
    with open(p, "rb") as f:
      os.fsync(f.fileno())


def truncate(path: str | os.PathLike, size: int) -> None:
  """Cuts a file to its first ``size`` bytes (an object is rewritten with them)."""
  p = as_path(path)
  if is_remote(p):
    p.write_bytes(p.read_bytes()[:size])
    return
  with open(p, "r+b") as f:
    f.truncate(size)


def walk(path: str | os.PathLike) -> Iterator[tuple[AnyPath, list[str], list[str]]]:
  """``os.walk`` for both kinds: (directory, its subdirectory names, its file names), top down;
  removing names from the subdirectory list skips them."""
  p = as_path(path)
  if not is_remote(p):
    for root, dirs, files in os.walk(p):
      yield Path(root), dirs, files
    return
  base = p.fs._strip_protocol(p.url).rstrip("/")  # pylint: disable=protected-access
  for root, dirs, files in p.fs.walk(p.url, topdown=True):
    rel = root.rstrip("/")[len(base):].strip("/")
    yield (p / rel if rel else p), dirs, files


def remove(path: str | os.PathLike) -> None:
  """Deletes a file or a directory tree; a path that is not there is skipped (a local link goes,
  not its target)."""
  p = as_path(path)
  if is_remote(p):
    if p.exists():
      p.fs.rm(p.url, recursive=True)
  elif p.is_dir() and not p.is_symlink():
    shutil.rmtree(p)
  else:
    p.unlink(missing_ok=True)


def lock_file(path: str | os.PathLike) -> Path:
  """The local file that locks the output ``path``: itself when local; for a URL, a file in the
  temporary directory named after it (object stores have no locks)."""
  if not is_remote(path):
    return Path(path)
  locks = Path(tempfile.gettempdir()) / "disa_jax_locks"
  locks.mkdir(exist_ok=True)
  return locks / (hashlib.sha256(str(path).encode()).hexdigest()[:24] + ".lock")


@contextlib.contextmanager
def staged_dir(dest: str | os.PathLike) -> Iterator[Path]:
  """A local directory whose files end up in ``dest``: ``dest`` itself when local; for a URL, a
  temporary directory uploaded file by file when the block ends without an error."""
  d = as_path(dest)
  if not is_remote(d):
    yield d
    return
  with tempfile.TemporaryDirectory(prefix="disa_stage_") as tmp:
    yield Path(tmp)
    for root, _, files in os.walk(tmp):
      for name in files:
        rel = Path(root, name).relative_to(tmp).as_posix()
        d.fs.put_file(os.path.join(root, name), str(d / rel))


@contextlib.contextmanager
def local_copy(src: str | os.PathLike) -> Iterator[Path]:
  """A local copy of the directory ``src``: ``src`` itself when local; for a URL, its files
  downloaded into a temporary directory (removed when the block ends)."""
  s = as_path(src)
  if not is_remote(s):
    yield s
    return
  if not s.is_dir():
    raise FileNotFoundError(errno.ENOENT, "No such directory", str(s))
  with tempfile.TemporaryDirectory(prefix="disa_fetch_") as tmp:
    for root, _, files in walk(s):
      for name in files:
        local = Path(tmp, (root / name).relative_to(s))
        local.parent.mkdir(parents=True, exist_ok=True)
        s.fs.get_file(str(root / name), str(local))
    yield Path(tmp)
