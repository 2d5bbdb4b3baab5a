"""benchmarks/bench_job_variants.py: a block's command trains the default job's shape under the
variant asked for, and the summary's medians and ratios are against the first variant."""
import argparse
import json
import pathlib

import pytest

from tests.benchmarks.scripts import load

bp = load("bench_job_variants")


def test_the_summary_takes_medians_over_blocks_and_ratios_to_the_first_variant():
  blocks = [{"variant": p, "median_run_s": r, "median_step_s": s}
            for p, r, s in [("process", 26.0, 0.126), ("inproc", 21.0, 0.108),
                            ("process", 30.0, 0.130), ("inproc", 20.0, 0.100),
                            ("process", 27.0, 0.120), ("inproc", 22.0, 0.110)]]
  out = bp.summarise(blocks, ["process", "inproc"])
  assert out["process"]["run_s"] == {"median": 27.0, "min": 26.0, "max": 30.0}
  assert out["inproc"]["run_s_ratio"] == pytest.approx(21.0 / 27.0)
  assert out["inproc"]["step_s_ratio"] == pytest.approx(0.108 / 0.126)
  assert out["process"]["run_s_ratio"] == 1.0 and out["inproc"]["blocks"] == 3


def test_a_variant_names_its_config_overrides_and_bad_ones_are_refused():
  assert bp.parse_variant("rows24:train.rollout.micro_batch_rows=24;train.tensorboard=False") == (
      "rows24", ("--config.train.rollout.micro_batch_rows=24", "--config.train.tensorboard=False"))
  for bad in ("rows24", "rows24:", ":a=1", "x:a", "x:=1"):
    with pytest.raises(SystemExit, match="--variant must be"):
      bp.parse_variant(bad)


def test_a_block_runs_the_default_job_with_the_variant_and_reads_its_runs(tmp_path, monkeypatch):
  """The block's command line (the default preset, the method, seeds, steps and the variant), and
  its figures read from the job's times.json and metrics (the job itself replaced here)."""
  (tmp_path / "prepared" / "models").mkdir(parents=True)
  (tmp_path / "prepared" / "exact.json").write_text("{}")
  seen = []

  def fake_run(cmd, cwd, check, stdout, stderr, text):
    seen.append(cmd)
    work = pathlib.Path(cmd[3].split("=", 1)[1])
    assert (work / "models").is_dir() and (work / "exact.json").exists()  # the prepared stages
    for k, step_s in enumerate((0.1, 0.3)):
      run = work / "stage3" / f"disa_seed{k}"
      run.mkdir(parents=True)
      rows = [{"step": i, "time/step_s": 9.0 if i == 0 else step_s} for i in range(5)]
      (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (work / "times.json").write_text(json.dumps({"stage1": 3.0, "stage3_disa": 20.0,
                                                 "stage3_disa_seed1": 24.0}))
    return bp.subprocess.CompletedProcess(cmd, 0, None, "")

  monkeypatch.setattr(bp.subprocess, "run", fake_run)
  args = argparse.Namespace(workdir=str(tmp_path), method="disa", seeds=2, steps=150, skip=1)
  b = bp.run_block(args, "inproc:engine.separate_process=False", 0)
  assert seen[0][1:3] == ["-m", "launch.main"]
  assert "--config.engine.separate_process=False" in seen[0]
  assert {"--config.methods=('disa',)", "--config.seeds=(0,1,)",
          "--config.train.total_steps=150"} <= set(seen[0])
  assert b["median_run_s"] == 22.0 and b["median_step_s"] == pytest.approx(0.2)
  assert b["variant"] == "inproc"
  assert not (tmp_path / "blocks" / "inproc_0" / "stage3").exists()  # removed after reading


def test_prepare_leaves_no_variant_outputs_and_a_failed_job_shows_its_error(tmp_path, monkeypatch):
  """Each variant's short run fills the cache; its Stage 3 and evaluation outputs go (the next
  variant's models differ in their bits: kept, its evaluation would refuse them); a failing job
  stops the benchmark with the job's command and the end of its stderr."""
  calls = []

  def fake_run(cmd, cwd, check, stdout, stderr, text):
    calls.append(cmd)
    work = pathlib.Path(cmd[3].split("=", 1)[1])
    for outputs in ("stage3", "eval", "models"):
      (work / outputs).mkdir(exist_ok=True)
    return bp.subprocess.CompletedProcess(cmd, 0 if len(calls) < 3 else 1, None, "Boom: bad rows")

  monkeypatch.setattr(bp.subprocess, "run", fake_run)
  args = argparse.Namespace(workdir=str(tmp_path), method="disa", seeds=2, steps=150,
                            variant=["a:train.rollout.micro_batch_rows=4",
                                     "b:train.rollout.micro_batch_rows=8"])
  bp.prepare(args)
  prepared = tmp_path / "prepared"
  assert [c[-1] for c in calls] == ["--config.train.rollout.micro_batch_rows=4",
                                    "--config.train.rollout.micro_batch_rows=8"]
  assert (prepared / "models").is_dir()
  assert not (prepared / "stage3").exists() and not (prepared / "eval").exists()
  with pytest.raises(SystemExit, match="(?s)failed \\(exit 1\\).*micro_batch_rows=4.*Boom: bad rows"):
    bp.prepare(args)
