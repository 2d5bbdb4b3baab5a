"""disa_jax.data.parquet: rows round-trip, and neither reading nor writing starts a thread (Arrow's
pools outliving the work abort a process at exit at random: the module docstring)."""
import json
import os
import subprocess
import sys

import pytest

from disa_jax.data import parquet
from disa_jax.data.rows import read_rows

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Run in a fresh process: another test's Arrow call may have started the pools in this one.
_THREADS = """
import json, os, sys
import pyarrow  # (its import starts helper threads of its own: counted before the work)
from disa_jax.data import parquet
count = lambda: len(os.listdir("/proc/self/task"))
rows = [{"id": i, "prompt": [{"role": "user", "content": f"q{i}"}], "x": i / 3} for i in range(50)]
before = count()
with open(sys.argv[1], "wb") as f:
  parquet.write_rows(rows, f)
with open(sys.argv[1], "rb") as f:
  back = parquet.read_rows(f)
print(json.dumps({"before": before, "after": count(), "same": back == rows}))
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_reading_and_writing_start_no_thread(tmp_path):
  out = subprocess.run([sys.executable, "-c", _THREADS, str(tmp_path / "r.parquet")], cwd=ROOT,
                       capture_output=True, text=True, timeout=120, check=True)
  got = json.loads(out.stdout.strip().splitlines()[-1])
  assert got["same"]
  assert got["after"] == got["before"], got


def test_rows_round_trip_through_a_path_and_an_unreadable_file_is_named(tmp_path):
  rows = [{"a": 1, "b": {"c": "x"}}, {"a": 2, "b": {"c": None}}]
  parquet.write_rows(rows, str(tmp_path / "p.parquet"))
  assert read_rows(str(tmp_path / "p.parquet")) == rows
  (tmp_path / "bad.parquet").write_bytes(b"not parquet at all")
  with pytest.raises(ValueError, match=r"bad\.parquet: not a readable parquet file"):
    read_rows(str(tmp_path / "bad.parquet"))
