"""The held-out validation split: seeded, by content (reruns and reordered inputs give the same
split), every column kept, a manifest, bad arguments named."""
import json
import os
import random
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from disa_jax.workflows.split_validation import file_sha256, manifest_path, split_validation
from disa_jax.tasks.prompts import load_prompts

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _rows(n):
  return [{"data_source": "math_dapo", "prompt": [{"content": f"Problem {i}: compute {i} * 3.",
                                                    "role": "user"}],
           "ability": "MATH", "reward_model": {"ground_truth": str(3 * i), "style": "rule"},
           "extra_info": {"index": f"id-{i:03d}"}} for i in range(n)]


def _write(rows, path):
  pq.write_table(pa.Table.from_pylist(rows), str(path))
  return str(path)


def _ids(path):
  return [r.prompt_id for r in load_prompts(str(path))]


def test_split_is_reproducible_and_independent_of_row_order(tmp_path):
  rows = _rows(40)
  src = _write(rows, tmp_path / "train.parquet")
  m = split_validation(src, str(tmp_path / "a_train.parquet"), str(tmp_path / "a_val.parquet"),
                       size=8, seed=3)
  assert (m.source_rows, m.train_rows, m.validation_rows) == (40, 32, 8)
  val, train = _ids(tmp_path / "a_val.parquet"), _ids(tmp_path / "a_train.parquet")
  assert sorted(val + train) == sorted(_ids(src)) and not set(val) & set(train)
  assert list(m.validation_prompt_ids) == val
  assert train == [i for i in _ids(src) if i not in val]  # file order kept
  # every column of the source rows is kept as it was
  assert pq.read_table(str(tmp_path / "a_val.parquet")).to_pylist() == [
      r for r in rows if f"math_dapo/{r['extra_info']['index']}" in val]
  # a rerun: the same bytes
  again = split_validation(src, str(tmp_path / "b_train.parquet"), str(tmp_path / "b_val.parquet"),
                           size=8, seed=3)
  assert (again.train_sha256, again.validation_sha256) == (m.train_sha256, m.validation_sha256)
  # the rows reordered, and as jsonl: the same validation prompts
  shuffled = rows[:]
  random.Random(0).shuffle(shuffled)
  src2 = tmp_path / "shuffled.jsonl"
  src2.write_text("".join(json.dumps(r) + "\n" for r in shuffled))
  m2 = split_validation(str(src2), str(tmp_path / "c_train.jsonl"), str(tmp_path / "c_val.jsonl"),
                        size=8, seed=3)
  assert sorted(m2.validation_prompt_ids) == sorted(val)
  # another seed, another split; the manifest is on disk
  m3 = split_validation(src, str(tmp_path / "d_train.parquet"), str(tmp_path / "d_val.parquet"),
                        size=8, seed=4)
  assert sorted(m3.validation_prompt_ids) != sorted(val)
  on_disk = json.loads(open(manifest_path(str(tmp_path / "a_val.parquet"))).read())
  assert on_disk["source_sha256"] == file_sha256(src) and on_disk["seed"] == 3
  assert on_disk["validation_prompt_ids"] == val


def test_duplicates_land_on_one_side(tmp_path):
  rows = _rows(10) + [dict(_rows(10)[i], extra_info={"index": f"dup-{i}"}) for i in range(10)]
  src = _write(rows, tmp_path / "dups.parquet")
  m = split_validation(src, str(tmp_path / "t.parquet"), str(tmp_path / "v.parquet"), size=3,
                       seed=0)
  assert m.validation_rows == 6 and m.train_rows == 14  # 3 contents, twice each
  val = {r.prompt_text() for r in load_prompts(str(tmp_path / "v.parquet"))}
  train = {r.prompt_text() for r in load_prompts(str(tmp_path / "t.parquet"))}
  assert len(val) == 3 and not val & train


def test_bad_arguments_are_named(tmp_path):
  src = _write(_rows(5), tmp_path / "p.parquet")
  with pytest.raises(ValueError, match=r"size must be an int in \[1, 4\] .* got 5"):
    split_validation(src, str(tmp_path / "t.parquet"), str(tmp_path / "v.parquet"), size=5, seed=0)
  with pytest.raises(ValueError, match="validation_path=.* is the input file"):
    split_validation(src, str(tmp_path / "t.parquet"), src, size=1, seed=0)
  with pytest.raises(ValueError, match=r"t\.csv: output must end in \.parquet or \.jsonl"):
    split_validation(src, str(tmp_path / "t.csv"), str(tmp_path / "v.parquet"), size=1, seed=0)
  bad = _rows(3)
  bad[1]["reward_model"] = {"ground_truth": None}
  with pytest.raises(ValueError, match=r"row 1: .*ground_truth"):
    split_validation(_write(bad, tmp_path / "bad.parquet"), str(tmp_path / "t.parquet"),
                     str(tmp_path / "v.parquet"), size=1, seed=0)


def test_command(tmp_path):
  src = _write(_rows(12), tmp_path / "p.parquet")
  cmd = [sys.executable, os.path.join(ROOT, "launch", "split_validation.py"), f"--input={src}",
         f"--train={tmp_path / 't.parquet'}", f"--validation={tmp_path / 'v.parquet'}",
         "--size=4", "--seed=1"]
  out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert out.returncode == 0, out.stderr[-3000:]
  assert json.loads(out.stdout)["validation_rows"] == 4 and len(_ids(tmp_path / "v.parquet")) == 4
