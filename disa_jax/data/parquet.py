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

import pyarrow as pa
import pyarrow.parquet as pq

ArrowError = pa.ArrowException  # what an unreadable file raises


def read_rows(f: BinaryIO) -> list[dict[str, Any]]:
  """The rows of the parquet file open in ``f`` (binary, read to its end), as dicts."""
  return pq.ParquetFile(pa.BufferReader(f.read())).read(use_threads=False).to_pylist()


def write_rows(rows: Sequence[dict[str, Any]], f: BinaryIO | str) -> None:
  """Writes ``rows`` (dicts with one schema) as one parquet table to ``f`` (a binary file or a
  path)."""
  pq.write_table(pa.Table.from_pylist(list(rows)), f)
