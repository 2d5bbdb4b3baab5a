"""Writing a stage's outputs: a file-system error names the file being written.

Python names the path when opening a file fails, but not when a later write, flush, fsync or
close does: a full disk gives ``[Errno 28] No space left on device`` and nothing else, and a library
writer (pyarrow's parquet writer) may not name it either. Inside `naming(path, what)` an `OSError`
becomes an `OutputWriteError`, an `OSError` with the same errno whose message says what was being
written and where, in one line (``[Errno 28] No space left on device (writing the Stage 1 dataset
part): '/data/stage1/part-000003.parquet.tmp'``), so that a command's error line says which disk is
full or read-only.
"""
from __future__ import annotations

import contextlib
import errno
import os
from typing import Iterator


class OutputWriteError(OSError):
  """An output could not be written: ``filename`` is its path, ``errno`` the cause's (EIO when the
  cause gave none), ``strerror`` the cause and what was being written."""


@contextlib.contextmanager
def naming(path: str | os.PathLike, what: str) -> Iterator[None]:
  """Re-raises an `OSError` from inside as an `OutputWriteError` naming ``path`` and ``what``.

  Args:
    path: the file (or directory) being written.
    what: what it holds, for the message (e.g. 'the Stage 3 metrics').

  Raises:
    OutputWriteError: from the `OSError` raised inside (chained to it); one that is already an
      `OutputWriteError` passes unchanged.
  """
  try:
    yield
  except OutputWriteError:
    raise
  except OSError as e:
    why = e.strerror or str(e) or type(e).__name__
    raise OutputWriteError(e.errno if e.errno is not None else errno.EIO, f"{why} (writing {what})",
                           os.fspath(path)) from e
