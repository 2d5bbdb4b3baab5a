"""wandb as a metrics sink (`disa_jax.rl.metrics.WandbSink`), run in wandb's offline mode.

The history is read back from the offline run files that wandb writes (`tests/rl/wandb_offline`),
so the test sees exactly what `wandb sync` would upload.
"""
from __future__ import annotations

import json

import pytest

from configs import stage3_base
from disa_jax import config as config_lib
from disa_jax.rl import config as rl_config
from disa_jax.rl.metrics import WANDB_STATE_FILE, MetricsLogger, read_jsonl

pytest.importorskip("wandb")
from tests.rl.wandb_offline import isolate_wandb, offline_runs  # noqa: E402  # needs wandb



@pytest.fixture(autouse=True)
def _wandb_home(tmp_path, monkeypatch):
  isolate_wandb(tmp_path, monkeypatch)


def _cfg(**kw) -> rl_config.WandbConfig:
  return rl_config.WandbConfig(enabled=True, mode="offline", project="disa-test", **kw)


def test_rows_config_and_resume_continue_one_run(tmp_path):
  run_dir = tmp_path / "run"
  run_config = {"train": {"seed": 3, "objective": {"name": "disa", "beta": 15.0}}}
  with MetricsLogger(str(run_dir), tensorboard=False, wandb=_cfg(tags=("disa", "tiny")),
                     run_config=run_config) as log:
    for s in range(1, 6):
      log.write(s, {"loss": s * 1.5, "kl": float("nan") if s == 2 else 0.1 * s})
  first_id = json.loads((run_dir / WANDB_STATE_FILE).read_text())["id"]
  # Resume from the checkpoint at step 3: steps 4 and 5 are recomputed (identically) and must not be
  # sent twice; 6 and 7 are new.
  with MetricsLogger(str(run_dir), resume_step=3, tensorboard=False, wandb=_cfg(),
                     run_config=run_config) as log:
    for s in range(4, 8):
      log.write(s, {"loss": s * 1.5, "kl": 0.1 * s})
  runs = offline_runs(run_dir)
  assert len(runs) == 2 and {r["id"] for r in runs} == {first_id}
  sent = [s for r in runs for s in r["history"]]
  assert sorted(sent) == [1, 2, 3, 4, 5, 6, 7], sent
  history = {s: row for r in runs for s, row in r["history"].items()}
  assert history[3] == {"loss": 4.5, "kl": pytest.approx(0.3)}
  assert history[7]["loss"] == 10.5
  assert history[2]["kl"] == "NaN" or history[2]["kl"] != history[2]["kl"]  # NaN is kept, not dropped
  first = next(r for r in runs if 1 in r["history"])  # the folders' order is wandb's timestamps
  assert all(r["config"]["train"] == run_config["train"] for r in runs)
  assert first["tags"] == ["disa", "tiny"]
  # The JSONL stays the source of truth, truncated and rewritten as before.
  assert [r["step"] for r in read_jsonl(str(run_dir / "metrics.jsonl"))] == [1, 2, 3, 4, 5, 6, 7]


def test_a_fresh_run_starts_a_new_wandb_run(tmp_path):
  with MetricsLogger(str(tmp_path), tensorboard=False, wandb=_cfg()) as log:
    log.write(1, {"a": 1.0})
  old = json.loads((tmp_path / WANDB_STATE_FILE).read_text())["id"]
  with MetricsLogger(str(tmp_path), tensorboard=False, wandb=_cfg()) as log:  # no resume_step
    log.write(1, {"a": 2.0})
  new = json.loads((tmp_path / WANDB_STATE_FILE).read_text())["id"]
  assert new != old
  assert sorted(r["id"] for r in offline_runs(tmp_path)) == sorted([old, new])


def test_disabled_writes_nothing_of_wandb(tmp_path):
  with MetricsLogger(str(tmp_path), tensorboard=False) as log:
    log.write(1, {"a": 1.0})
  assert not (tmp_path / "wandb").exists() and not (tmp_path / WANDB_STATE_FILE).exists()


def test_a_torn_state_file_is_named(tmp_path):
  (tmp_path / WANDB_STATE_FILE).write_text('{"id": "ab')
  with pytest.raises(ValueError, match=f"{WANDB_STATE_FILE}: unreadable wandb run state"):
    MetricsLogger(str(tmp_path), resume_step=2, tensorboard=False, wandb=_cfg())


def test_the_stage3_config_section_converts_and_validates():
  cfg = config_lib.from_mapping(rl_config.WandbConfig, stage3_base.get_config().train.wandb,
                                "train.wandb")
  assert cfg == rl_config.WandbConfig()  # the config file's comments describe the defaults
  with pytest.raises(ValueError, match="train.wandb.mode must be one of .* got 'cloud'"):
    config_lib.from_mapping(rl_config.WandbConfig, {"mode": "cloud"}, "train.wandb")
  with pytest.raises(ValueError, match="tags\\[1\\] must be a non-empty string"):
    config_lib.from_mapping(rl_config.WandbConfig, {"tags": ["a", ""]}, "train.wandb")
  train = config_lib.from_mapping(rl_config.TrainConfig, {"wandb": {"enabled": True,
                                                                    "tags": ["x"]}}, "train")
  assert train.wandb == rl_config.WandbConfig(enabled=True, tags=("x",))


def test_every_run_is_on_disk_when_the_logger_closes(tmp_path):
  """Read at once after close, each offline run holds its run record and rows (finish() alone
  returned before wandb's service had flushed the record log: 4 of 15 runs read empty)."""
  for i in range(10):  # a missing flush showed in ~1 of 4 runs
    run_dir = tmp_path / f"run{i}"
    with MetricsLogger(str(run_dir), tensorboard=False, wandb=_cfg()) as log:
      log.write(1, {"loss": float(i)})
    runs = offline_runs(run_dir)
    assert [(r["id"] is not None, r["history"]) for r in runs] == [(True, {1: {"loss": float(i)}})]
