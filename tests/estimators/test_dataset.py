"""Stage 1 dataset: schema, append-only resume, crash repair, validation by row index and reason,
parts that never replace each other, one writer at a time."""
import json
import math
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from disa_jax import codec
from disa_jax.checkpoint.lock import OutputLockedError
from disa_jax.estimators import (RewardTransform, Stage1FormatError, Stage1Writer, build_records, load_stage1,
                                 log_z_is)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

RT = RewardTransform(kind="raw")


def _samples(seed, n):
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(n):
    k = int(rng.integers(1, 6))
    out.append({"token_ids": rng.integers(0, 50, k).tolist(), "text": "x" * k,
                "logp_ref": float(-rng.uniform(1, 8)), "logp_proposal": float(-rng.uniform(1, 8)),
                "reward": float(rng.integers(0, 2)), "num_tokens": k})
  return out


def _records(ids, seed=0, scale="sum"):
  samples = [_samples(seed + i, 3 + i % 3) for i in range(len(ids))]  # ragged N
  return build_records(ids, [f"prompt {i}" for i in ids], samples, beta=2.0, reward_transform=RT,
                       label_scale=scale)


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_roundtrip_labels_and_resume(tmp_path, fmt):
  path = tmp_path / ("s1.jsonl" if fmt == "jsonl" else "s1")
  w = Stage1Writer(path, fmt=fmt)
  recs = _records(["a", "b", "c"])
  w.write(recs[:2])
  w.close()
  # a rerun (new writer) sees what is finished and skips it
  w2 = Stage1Writer(path, fmt=fmt)
  assert w2.completed_ids() == {"a", "b"}
  todo = [r for r in recs if r["prompt_id"] not in w2.completed_ids()]
  w2.write(todo)
  with pytest.raises(ValueError, match="duplicate"):
    w2.write(recs[:1])
  data = load_stage1(path, fmt=fmt)
  assert data.prompt_ids == ["a", "b", "c"]
  assert data.mask.sum(1).tolist() == [3, 4, 5]
  np.testing.assert_allclose(data.labels, [r["log_z_is"] for r in recs], rtol=1e-6)
  # stored labels equal eq. (8) recomputed from the stored per-sample fields
  np.testing.assert_allclose(np.asarray(log_z_is(data.log_weights(), data.mask)), data.labels, rtol=1e-5)
  # the other scale is available from the same file
  mean_labels = np.asarray(log_z_is(data.log_weights("mean"), data.mask))
  np.testing.assert_allclose(mean_labels, [r["log_z_is"] for r in _records(["a", "b", "c"], scale="mean")],
                             rtol=1e-5)


def test_label_is_eq6_by_hand():
  s = [{"token_ids": [1], "text": "a", "logp_ref": -1.0, "logp_proposal": -2.0, "reward": 1.0, "num_tokens": 1},
       {"token_ids": [2, 3], "text": "bc", "logp_ref": -3.0, "logp_proposal": -1.0, "reward": 0.0,
        "num_tokens": 2}]
  rec = build_records(["q"], ["q"], [s], beta=2.0, reward_transform=RT)[0]
  lw = [-1 + 2 + 2.0, -3 + 1]
  assert rec["log_z_is"] == pytest.approx(math.log((math.exp(lw[0]) + math.exp(lw[1])) / 2), rel=1e-6)
  assert rec["n_valid"] == 2 and rec["reward_transform"] == codec.encode(RT)


def test_killed_run_partial_line_is_repaired(tmp_path):
  path = tmp_path / "s1.jsonl"
  Stage1Writer(path).write(_records(["a", "b"]))
  with open(path, "a") as f:  # a crash in the middle of writing "c"
    f.write(json.dumps(_records(["c"])[0])[:40])
  with pytest.warns(UserWarning, match="partial last line"):
    w = Stage1Writer(path)
  assert w.completed_ids() == {"a", "b"}
  w.write(_records(["c"]))
  assert load_stage1(path).prompt_ids == ["a", "b", "c"]


def test_parquet_leftover_tmp_part_is_discarded(tmp_path):
  path = tmp_path / "s1"
  Stage1Writer(path, fmt="parquet").write(_records(["a"]))
  (path / "part-000001.parquet.tmp").write_bytes(b"garbage from a killed run")
  w = Stage1Writer(path, fmt="parquet")
  assert w.completed_ids() == {"a"} and not list(path.glob("*.tmp"))


def test_validation_reports_every_bad_row(tmp_path):
  path = tmp_path / "bad.jsonl"
  good = _records(["a", "b", "c", "d", "e", "f"])
  good[1]["samples"][0]["logp_proposal"] = float("nan")
  del good[2]["samples"][1]["reward"]
  good[3]["label_scale"] = "median"
  good[4]["samples"] = []
  good[5]["prompt_id"] = "a"
  with open(path, "w") as f:
    for r in good:
      f.write(json.dumps(r) + "\n")
    f.write("{not json\n")
  with pytest.raises(Stage1FormatError) as e:
    load_stage1(path)
  rows = dict(e.value.errors)
  assert sorted(rows) == [1, 2, 3, 4, 5, 6]
  assert "logp_proposal" in rows[1] and "reward" in rows[2] and "label_scale" in rows[3]
  assert "non-empty" in rows[4] and "duplicate" in rows[5] and "JSON" in rows[6]


def test_inconsistent_beta_is_refused(tmp_path):
  path = tmp_path / "mixed.jsonl"
  recs = _records(["a", "b"])
  recs[1]["beta"] = 3.0
  path.write_text("".join(json.dumps(r) + "\n" for r in recs))
  with pytest.raises(Stage1FormatError, match="beta"):
    load_stage1(path)


def test_parquet_resume_never_overwrites_a_finished_part(tmp_path):
  """Parts 1 and 2 left, part 0 gone (finding 5): the resumed batch gets a new part, every earlier
  prompt's samples survive."""
  path = tmp_path / "s1"
  recs = _records(["a", "b", "c", "d"])
  with Stage1Writer(path, fmt="parquet") as w:
    for r in recs[:3]:
      w.write([r])
  (path / "part-000000.parquet").unlink()  # prompt "a" is lost: a rerun redoes it
  with Stage1Writer(path, fmt="parquet") as w:
    assert w.completed_ids() == {"b", "c"}
    w.write([recs[0], recs[3]])
  assert sorted(p.name for p in path.glob("part-*")) == ["part-000001.parquet", "part-000002.parquet",
                                                         "part-000003.parquet"]
  data = load_stage1(path, fmt="parquet")
  assert sorted(data.prompt_ids) == ["a", "b", "c", "d"]
  by_id = {r["prompt_id"]: r for r in data.records}
  for r in recs:
    assert [s["token_ids"] for s in by_id[r["prompt_id"]]["samples"]] == [
        s["token_ids"] for s in r["samples"]]
  # The typed view later stages read: one Stage1Sample per stored sample, the same values.
  for pid, samples in zip(data.prompt_ids, data.samples):
    stored = by_id[pid]["samples"]
    assert [s.token_ids for s in samples] == [tuple(s["token_ids"]) for s in stored]
    assert [(s.reward, s.logp_ref, s.num_tokens) for s in samples] == [
        (float(s["reward"]), float(s["logp_ref"]), s["num_tokens"]) for s in stored]


@pytest.mark.parametrize("name", ["s1.jsonl", "s1"])
def test_second_writer_in_another_process_gets_a_named_error(tmp_path, name):
  """Finding 6: a job launched twice must not append the same prompts twice."""
  path = tmp_path / name
  holder = subprocess.Popen(
      [sys.executable, "-c", textwrap.dedent(f"""
          import sys
          from disa_jax.estimators.dataset import Stage1Writer
          w = Stage1Writer({str(path)!r})
          print("locked", flush=True)
          sys.stdin.readline()
          w.close()
          print("released", flush=True)
          sys.stdin.readline()
          """)],
      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT,
      env=dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu"))
  try:
    assert holder.stdout.readline().strip() == "locked"
    with pytest.raises(OutputLockedError, match=f"pid {holder.pid}") as e:
      Stage1Writer(path)
    assert str(path) in str(e.value) and e.value.holder_pid == holder.pid
    holder.stdin.write("\n")
    holder.stdin.flush()
    assert holder.stdout.readline().strip() == "released"
    Stage1Writer(path).close()  # released by close: a later writer opens
  finally:
    holder.kill()
    holder.wait()


def test_lock_dies_with_a_killed_holder(tmp_path):
  path = tmp_path / "s1.jsonl"
  holder = subprocess.Popen(
      [sys.executable, "-c", "import sys; from disa_jax.estimators.dataset import Stage1Writer; "
       f"w = Stage1Writer({str(path)!r}); print('locked', flush=True); sys.stdin.readline()"],
      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT,
      env=dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu"))
  assert holder.stdout.readline().strip() == "locked"
  with pytest.raises(OutputLockedError):
    Stage1Writer(path)
  holder.kill()  # SIGKILL: no cleanup runs; the kernel drops the flock
  holder.wait()
  with Stage1Writer(path) as w:
    w.write(_records(["a"]))
  assert load_stage1(path).prompt_ids == ["a"]


def test_same_process_second_writer_is_refused_until_close(tmp_path):
  path = tmp_path / "s1.jsonl"
  w = Stage1Writer(path)
  with pytest.raises(OutputLockedError, match=f"pid {os.getpid()}"):
    Stage1Writer(path)
  w.close()
  with pytest.raises(RuntimeError, match="closed"):
    w.write(_records(["a"]))
  Stage1Writer(path).close()


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_bad_stats_are_reported_with_file_row_and_field(tmp_path, fmt):
  """Finding 9: a non-numeric stored statistic names the file, the row and the field."""
  recs = _records(["a", "b", "c", "d"])
  recs[1]["log_z_is"] = "abc"
  recs[3]["ess"] = [1.0]
  recs[3]["log_z_gm"] = "x"
  if fmt == "jsonl":
    path = tmp_path / "s1.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
  else:
    import pyarrow as pa  # pylint: disable=g-import-not-at-top
    import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
    path = tmp_path / "s1"
    path.mkdir()
    for k, r in enumerate(recs):
      row = dict(r, reward_transform=json.dumps(r["reward_transform"]),
                 **{f: json.dumps(r[f]) for f in ("log_z_is", "log_z_gm", "ess")})
      pq.write_table(pa.Table.from_pylist([row]), path / f"part-{k:06d}.parquet")
  with pytest.raises(Stage1FormatError) as e:
    load_stage1(path, fmt=fmt)
  rows = dict(e.value.errors)
  assert str(path) in str(e.value)
  if fmt == "jsonl":
    assert sorted(rows) == [1, 3]
    assert "log_z_is='abc'" in rows[1] and "log_z_gm='x'" in rows[3]
  else:  # every row holds strings in the stats columns here
    assert sorted(rows) == [0, 1, 2, 3] and "part-000001.parquet" in rows[1]
    assert "log_z_is='\"abc\"'" in rows[1]
