"""Remote paths (issue 43, point 7): prompt files, the Stage 1 dataset, anchors, stage identities
and preflight take a URL (``gs://`` in docs/cluster.md; any fsspec scheme) through the one path
module, `disa_jax.paths`. Offline, fsspec's in-memory file system (``memory://``) stands in for a
bucket: the same code reads and writes it as it would ``gs://``. Local files keep their bytes."""
import json
import os
import uuid

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from flax import nnx

from configs import stage1_paper, stage2_paper
from disa_jax import paths, testing
from disa_jax.anchor import Anchor, AnchorMLP, load_anchor
from disa_jax.anchor.frozen import AnchorMeta, EmbeddingSpec
from disa_jax.checkpoint.identity import IdentityMismatchError, fingerprint
from disa_jax.checkpoint.lock import OutputLockedError
from disa_jax.data.records import PromptRecord
from disa_jax.data.rows import read_rows, save_prompts
from disa_jax.estimators import RewardTransform, Stage1Writer, build_records, load_stage1
from disa_jax.tasks.prompts import load_prompts
from disa_jax.workflows import preflight
from disa_jax.workflows.stage1 import Stage1Config, claim_stage1_output
from disa_jax.workflows.stage2 import Stage2Config


@pytest.fixture()
def mem():
  """A fresh ``memory://`` directory (a stand-in for a bucket), removed afterwards."""
  root = f"memory://disa-test-{uuid.uuid4().hex}"
  yield root
  paths.remove(root)


def _upload(local, url):
  """The local file's bytes as the object ``url``."""
  paths.as_path(url).write_bytes(open(local, "rb").read())
  return url


def _records(ids, seed=0):
  rng = np.random.default_rng(seed)
  samples = [[{"token_ids": [int(t) for t in rng.integers(3, 50, 3)], "text": "abc",
               "logp_ref": float(-rng.uniform(1, 5)), "logp_proposal": -2.0,
               "reward": float(j % 2), "num_tokens": 3} for j in range(3)] for _ in ids]
  return build_records(ids, [f"prompt {i}" for i in ids], samples, beta=2.0,
                       reward_transform=RewardTransform(kind="raw"))


def test_a_prompt_file_is_read_from_a_url_as_from_disk(tmp_path, mem):
  records = [PromptRecord(f"q{i}", f"what is {i} + {i}?", str(2 * i), "toy") for i in range(3)]
  for name in ("p.jsonl", "p.parquet"):
    local = str(tmp_path / name)
    save_prompts(records, local)
    save_prompts(records, f"{mem}/{name}")  # written there as on disk: the same bytes
    assert paths.as_path(f"{mem}/{name}").read_bytes() == open(local, "rb").read()
    assert load_prompts(f"{mem}/{name}") == load_prompts(local)
  gz = os.path.join(os.path.dirname(__file__), "fixtures", "benchmarks",
                    "humanevalplus_sample.jsonl.gz")
  url = _upload(gz, f"{mem}/bench/HumanEvalPlus.jsonl.gz")
  assert read_rows(url) == read_rows(gz)
  with pytest.raises(FileNotFoundError, match="missing.jsonl"):
    load_prompts(f"{mem}/missing.jsonl")


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_a_stage1_dataset_is_written_and_resumed_at_a_url(tmp_path, mem, fmt):
  name = "stage1.jsonl" if fmt == "jsonl" else "stage1"
  url, local = f"{mem}/s1/{name}", tmp_path / name
  for where in (url, local):
    with Stage1Writer(where, fmt) as w:  # a first run, stopped after two prompts
      assert w.write(_records(["a", "b"])) == 2
      with pytest.raises(OutputLockedError):  # one writer at a time, a URL's too
        Stage1Writer(where, fmt)
    with Stage1Writer(where, fmt) as w:  # the rerun skips them and writes the rest
      assert w.completed_ids() == {"a", "b"}
      with pytest.raises(ValueError, match="duplicate prompt_id"):
        w.write(_records(["b"]))
      w.write(_records(["c"], seed=1))
  remote, disk = load_stage1(url), load_stage1(local)
  assert remote.prompt_ids == disk.prompt_ids == ["a", "b", "c"]
  assert remote.records == disk.records
  if fmt == "parquet":  # the parts, byte for byte, and as pyarrow writes them to a path
    parts = sorted(p.name for p in paths.as_path(url).iterdir())  # (its lock is a local file)
    assert parts == ["part-000000.parquet", "part-000001.parquet"]
    assert sorted(os.listdir(local)) == [".lock", *parts]
    for part in parts:
      assert (paths.as_path(url) / part).read_bytes() == (local / part).read_bytes()
    rows = [dict(r, reward_transform=json.dumps(r["reward_transform"]))
            for r in _records(["c"], seed=1)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "direct.parquet")  # as it was written
    assert (tmp_path / "direct.parquet").read_bytes() == (local / parts[1]).read_bytes()
  else:  # a line cut by a crash is dropped and recomputed, in an object too
    whole = paths.as_path(url).read_bytes()
    paths.as_path(url).write_bytes(whole + b'{"prompt_id": "d", "pro')
    with pytest.warns(UserWarning, match="dropping a partial last line"):
      w = Stage1Writer(url, fmt)
    assert w.completed_ids() == {"a", "b", "c"} and paths.as_path(url).read_bytes() == whole
    w.close()


def test_an_anchor_is_saved_and_loaded_at_a_url(tmp_path, mem):
  meta = AnchorMeta(embedding=EmbeddingSpec("model_mean_pool", 8, "/models/ref",
                                            rendering="plain", model_sha256="ab" * 32),
                    beta=2.0, reward_transform=RewardTransform(kind="group_zscore"),
                    label_scale="mean", hidden_sizes=(8,))
  anchor = Anchor(AnchorMLP(8, (8,), "relu", rngs=nnx.Rngs(4)), meta)
  url = f"{mem}/anchors/run"
  assert str(anchor.save(url)) == url
  anchor.save(tmp_path / "anchor")
  local_files = {str(p.relative_to(tmp_path / "anchor")) for p in (tmp_path / "anchor").rglob("*")
                 if p.is_file()}
  remote_files = {str((root / n).relative_to(paths.as_path(url)))
                  for root, _, names in paths.walk(url) for n in names}
  shape = lambda files: {os.path.dirname(f) if "/d/" in f else f for f in files}
  assert shape(remote_files) == shape(local_files)  # the same files (orbax's data chunks vary)
  x = np.random.default_rng(0).normal(size=(5, 8)).astype(np.float32)
  loaded = load_anchor(url)
  assert isinstance(loaded, Anchor) and loaded.meta == meta
  np.testing.assert_allclose(np.asarray(loaded(x)), np.asarray(anchor(x)), rtol=1e-6)
  with pytest.raises(FileExistsError, match="already holds an anchor"):
    anchor.save(url)
  with pytest.raises(FileNotFoundError, match="not an anchor directory"):
    Anchor.load(f"{mem}/anchors/none")


def test_stage_identities_hash_and_claim_outputs_at_a_url(tmp_path, mem):
  (tmp_path / "ref").mkdir()
  (tmp_path / "ref" / "model.safetensors").write_bytes(b"weights")
  (tmp_path / "ref" / "config.json").write_text("{}")
  for f in ("model.safetensors", "config.json"):
    _upload(tmp_path / "ref" / f, f"{mem}/ref/{f}")
  assert fingerprint(f"{mem}/ref") == fingerprint(tmp_path / "ref")  # the same bytes, anywhere
  prompts = paths.as_path(f"{mem}/data/prompts.jsonl")
  prompts.write_text('{"prompt": "p"}\n')
  c = stage1_paper.get_config("qwen3-4b-base,math")  # no engine or model starts here
  c.output_dir, c.prompts_path = f"{mem}/out", str(prompts)
  c.reference_path = c.proposal_path = str(tmp_path / "ref")
  cfg = Stage1Config.from_config(c)
  assert claim_stage1_output(cfg) == "new"
  assert paths.as_path(f"{mem}/out/stage1_identity.json").is_file()
  assert claim_stage1_output(cfg) == "resumed"
  with Stage1Writer(cfg.dataset_path(), cfg.dataset_format) as w:  # the labels of a first run
    w.write(_records(["a"]))
  prompts.write_text('{"prompt": "another"}\n')  # the same URL, other content
  with pytest.raises(IdentityMismatchError) as e:
    claim_stage1_output(cfg)
  assert set(e.value.diffs) == {"prompts_path.sha256"} and f"{mem}/out" in str(e.value)


def test_preflight_checks_a_url_where_it_is_and_names_a_missing_one(tmp_path, mem):
  ref = testing.save_tiny_checkpoint(str(tmp_path / "ref"))
  stage1 = paths.as_path(f"{mem}/s1/stage1")
  with Stage1Writer(stage1) as w:
    w.write(_records(["a"]))
  c = stage2_paper.get_config("qwen3-4b-base,math")
  c.stage1_path, c.reference_path = str(stage1), ref
  c.anchor_path, c.output_dir = f"{mem}/anchor", f"{mem}/s2"
  c.embedding.mesh.num_devices = 1
  cfg = Stage2Config.from_config(c)
  preflight.preflight(cfg)  # the dataset is found where the URL says
  preflight.check_outputs(cfg)  # the outputs can be written there (a probe, removed at once)
  assert sorted(p.name for p in paths.as_path(mem).iterdir()) == ["s1"]
  missing = Stage2Config.from_config({**c.to_dict(), "stage1_path": f"{mem}/s1/gone"})
  with pytest.raises(preflight.PreflightError,
                     match=rf"stage1_path='{mem}/s1/gone': no such file or directory"):
    preflight.preflight(missing)
  remote_model = Stage2Config.from_config({**c.to_dict(), "reference_path": f"{mem}/ref"})
  with pytest.raises(preflight.PreflightError,
                     match=rf"reference_path='{mem}/ref': a model must be a local directory"):
    preflight.preflight(remote_model)
  unknown = Stage2Config.from_config({**c.to_dict(), "stage1_path": "nosuch://bucket/s1"})
  with pytest.raises(ValueError, match=r"nosuch://bucket/s1: cannot open nosuch:// paths here"):
    preflight.preflight(unknown)
