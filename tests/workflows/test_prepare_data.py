"""launch/prepare_data.py's module on small made-up sets: Hugging Face dataset directories (saved
with `datasets`), a local file, the outputs read back by the configs' loaders, provenance, and
bad rows named with their row and field."""
import importlib.util
import json
import os
import subprocess
import sys

import pyarrow.parquet as pq
import pytest

from disa_jax import testing
from disa_jax.tasks.prompts import load_prompts
from disa_jax.workflows import prepare_data as prepare
from disa_jax.workflows.split_validation import file_sha256

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(autouse=True)
def _needs_datasets():
  testing.require(importlib.util.find_spec("datasets") is not None,
                  "the datasets package (the 'data' extra) is not installed")


def _dapo_rows(n):
  """Rows shaped like open-r1/DAPO-Math-17k-Processed (`prompt` the user text)."""
  return [{"prompt": f"Solve: {i} + {i} = ?", "solution": str(2 * i), "data_source": "math_dapo",
           "source_prompt": [{"content": f"Solve: {i} + {i} = ?", "role": "user"}],
           "ability": "MATH", "reward_model": {"ground_truth": str(2 * i), "style": "rule"},
           "extra_info": {"index": f"u-{i}"}} for i in range(n)]


def _code_rows(n, tag):
  """Rows shaped like DeepCoder-Preview-Dataset's (tests and metadata as JSON strings)."""
  return [{"problem": f"{tag} problem {i}: print the input doubled.",
           "tests": json.dumps([{"input": f"{i}\n", "output": f"{2 * i}\n", "testtype": "stdin"}]),
           "metadata": json.dumps({})} for i in range(n)]


def test_training_set_from_a_saved_dataset_dict(tmp_path):
  import datasets  # pylint: disable=g-import-not-at-top
  src = tmp_path / "dapo_hf"
  datasets.DatasetDict({"train": datasets.Dataset.from_list(_dapo_rows(5))}).save_to_disk(str(src))
  out = tmp_path / "data" / "dapo.parquet"
  prov = prepare.prepare("dapo-17k-processed", str(src), str(out))
  records = load_prompts(str(out))  # what Stages 1-3 read (format 'auto' -> veRL)
  assert [r.prompt_id for r in records] == [f"math_dapo/u-{i}" for i in range(5)]
  assert pq.read_table(str(out)).to_pylist() == _dapo_rows(5)  # every column as it was
  assert [r.ground_truth for r in records] == [str(2 * i) for i in range(5)]
  assert records[3].prompt_text() == "Solve: 3 + 3 = ?"
  on_disk = json.loads((tmp_path / "data" / "dapo.parquet.provenance.json").read_text())
  assert on_disk == prov
  assert (prov["source_kind"], prov["split"], prov["rows_read"], prov["rows_written"]) == (
      "hf_dir", "train", 5, 5)
  assert prov["sha256"] == file_sha256(str(out)) and prov["identity"]["en"]


def test_deepcoder_concatenates_its_configs(tmp_path):
  import datasets  # pylint: disable=g-import-not-at-top
  parts = {}
  for tag, n in (("primeintellect", 3), ("taco", 2)):
    parts[tag] = tmp_path / tag
    datasets.Dataset.from_list(_code_rows(n, tag)).save_to_disk(str(parts[tag]))  # one split
  # a directory per config: read each as its own source, as a downloaded repo lays them out
  out = tmp_path / "deepcoder.parquet"
  provs = [prepare.prepare("deepcoder", str(parts[t]), str(tmp_path / f"{t}.parquet"),
                           configs=(t,)) for t in parts]
  assert [p["rows_written"] for p in provs] == [3, 2]
  records = load_prompts(str(tmp_path / "taco.parquet"))
  assert records[1].ability == "code" and records[1].ground_truth[0]["output"] == "2\n"
  # one source with several configs: a local hub-style repository read by load_dataset
  repo = tmp_path / "repo"
  for tag in parts:
    (repo / tag).mkdir(parents=True)
    datasets.Dataset.from_list(_code_rows(2, tag)).to_parquet(str(repo / tag / "train.parquet"))
  (repo / "README.md").write_text(
      "---\nconfigs:\n" + "".join(f"- config_name: {t}\n  data_files:\n  - split: train\n    "
                                  f"path: {t}/train.parquet\n" for t in parts) + "---\n")
  prov = prepare.prepare("deepcoder", str(repo), str(out), configs=tuple(parts))
  assert prov["configs"] == list(parts) and prov["rows_written"] == 4
  records = load_prompts(str(out))
  assert len({r.prompt_id for r in records}) == 4
  assert [r.extra["problem"].split()[0] for r in records] == ["primeintellect"] * 2 + ["taco"] * 2


def test_benchmark_from_a_file_keeps_its_rows(tmp_path):
  rows = [{"problem": "What is 1+1?", "answer": "2", "id": 0},
          {"problem": "What is 2+3?", "answer": "5", "id": 1}]
  src = tmp_path / "in.jsonl"
  src.write_text("".join(json.dumps(r) + "\n" for r in rows))
  out = tmp_path / "aime24.jsonl"
  prov = prepare.prepare("aime24", str(src), str(out))
  assert [json.loads(l) for l in out.read_text().splitlines()] == rows
  assert prov["identity"] == {"file": file_sha256(str(src))} and prov["split"] is None
  records = load_prompts(str(out), "aime24")  # as the evaluation reads it
  assert [r.ground_truth for r in records] == ["2", "5"]


def test_bad_rows_and_sources_are_named(tmp_path):
  import datasets  # pylint: disable=g-import-not-at-top
  rows = _dapo_rows(4)
  rows[2]["reward_model"] = {"ground_truth": "", "style": "rule"}
  src = tmp_path / "bad"
  datasets.Dataset.from_list(rows).save_to_disk(str(src))
  with pytest.raises(ValueError, match=r"dapo-17k-processed: .*bad.* row 2: "
                                       r"reward_model\.ground_truth"):
    prepare.prepare("dapo-17k-processed", str(src), str(tmp_path / "o.parquet"))
  assert not (tmp_path / "o.parquet").exists()
  with pytest.raises(ValueError, match="set must be one of .*, got 'gsm8k'"):
    prepare.prepare("gsm8k", str(src))
  with pytest.raises(FileNotFoundError, match=r"source='/no/such/file\.jsonl': no such file"):
    prepare.prepare("aime24", "/no/such/file.jsonl")
  good = tmp_path / "good.jsonl"
  good.write_text(json.dumps({"problem": "p", "answer": "1"}) + "\n")
  with pytest.raises(ValueError, match=r"x\.csv: output must end in \.parquet or \.jsonl"):
    prepare.prepare("aime24", str(good), str(tmp_path / "x.csv"))


def test_command(tmp_path):
  src = tmp_path / "m.jsonl"
  src.write_text(json.dumps({"problem": "p", "answer": "1", "unique_id": "a"}) + "\n")
  out = subprocess.run([sys.executable, os.path.join(ROOT, "launch", "prepare_data.py"),
                        "--set=math500", f"--source={src}", f"--output={tmp_path / 'o.jsonl'}"],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert out.returncode == 0, out.stderr[-3000:]
  assert json.loads(out.stdout)["rows_written"] == 1


def test_the_dry_run_checks_a_local_source_and_writes_nothing(tmp_path):
  """``--dry_run`` (`prepare.plan`): a local file is taken as a path (no hub lookup), the output's
  format is checked, nothing is read or written; a local-looking source that is missing is named."""
  src = tmp_path / "m.jsonl"
  src.write_text("not even json\n")  # the plan reads nothing, so a bad row is not seen
  out = tmp_path / "o" / "math500.jsonl"
  got = prepare.plan("math500", str(src), str(out))
  assert got["source_kind"] == "file" and got["configs"] == [""] and got["split"] is None
  assert got["output"] == str(out) and not out.parent.exists()
  with pytest.raises(FileNotFoundError, match=r"\./dl/MATH-500"):
    prepare.plan("math500", "./dl/MATH-500", str(out))
  with pytest.raises(ValueError, match=r"o\.csv: output must end in \.parquet or \.jsonl"):
    prepare.plan("math500", str(src), str(tmp_path / "o.csv"))
