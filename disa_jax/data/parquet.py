"""Parquet rows in and out, without Arrow's thread pools: the one place the package reads or writes
parquet (prompt files, validation splits, Stage 1 dataset parts).

`pq.read_table` scans through Arrow's dataset layer, which starts the process-wide CPU and I/O
thread pools; they outlive the read, and a process that exits with one of their workers still
joinable dies in `std::terminate` ("terminate called without an active exception", SIGABRT)
after its work is done, at random (arrow#34314; it failed `launch/split_validation.py` in CI).
Here a file is read whole into memory and decoded on the calling thread (`use_threads=False` over
an in-memory buffer: no pool is touched), and written with `pq.write_table`, which starts none.
`tests/data/test_parquet.py` checks that neither starts a thread.
"""
from __future__ import annotations

from typing import Any, BinaryIO, Sequence


class ParquetError(ValueError):
  """An unreadable parquet file (Arrow's error, its message kept)."""


def read_rows(f: BinaryIO) -> list[dict[str, Any]]:
  """The rows of the parquet file open in ``f`` (binary, read to its end), as dicts.

  Raises:
    ParquetError: the bytes are not a readable parquet file.
  """
  import pyarrow as pa  # pylint: disable=g-import-not-at-top  (heavy import, only where used)
  import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top  (heavy import)
  try:
    return pq.ParquetFile(pa.BufferReader(f.read())).read(use_threads=False).to_pylist()
  except pa.ArrowException as e:
    raise ParquetError(str(e)) from e


def write_rows(rows: Sequence[dict[str, Any]], f: BinaryIO | str) -> None:
  """Writes ``rows`` (dicts with one schema) as one parquet table to ``f`` (a binary file or a
  path)."""
  import pyarrow as pa  # pylint: disable=g-import-not-at-top  (heavy import, only where used)
  import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top  (heavy import)
  pq.write_table(pa.Table.from_pylist(list(rows)), f)
