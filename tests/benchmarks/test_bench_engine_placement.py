"""benchmarks/bench_engine_placement.py: a block's command trains the default job's shape with the
placement asked for, and the summary's medians and ratios are against the first placement."""
import argparse
import importlib.util
import json
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("bench_engine_placement",
                                               ROOT / "benchmarks" / "bench_engine_placement.py")
bp = sys.modules["bench_engine_placement"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bp)


def test_the_summary_takes_medians_over_blocks_and_ratios_to_the_first_placement():
  blocks = [{"placement": p, "median_run_s": r, "median_step_s": s}
            for p, r, s in [("process", 26.0, 0.126), ("inproc", 21.0, 0.108),
                            ("process", 30.0, 0.130), ("inproc", 20.0, 0.100),
                            ("process", 27.0, 0.120), ("inproc", 22.0, 0.110)]]
  out = bp.summarise(blocks, ["process", "inproc"])
  assert out["process"]["run_s"] == {"median": 27.0, "min": 26.0, "max": 30.0}
  assert out["inproc"]["run_s_ratio"] == pytest.approx(21.0 / 27.0)
  assert out["inproc"]["step_s_ratio"] == pytest.approx(0.108 / 0.126)
  assert out["process"]["run_s_ratio"] == 1.0 and out["inproc"]["blocks"] == 3


def test_a_block_runs_the_default_job_with_the_placement_and_reads_its_runs(tmp_path, monkeypatch):
  """The block's command line (the default preset, the method, seeds, steps and placement), and
  its figures read from the job's times.json and metrics (the job itself replaced here)."""
  (tmp_path / "prepared" / "models").mkdir(parents=True)
  (tmp_path / "prepared" / "exact.json").write_text("{}")
  seen = []

  def fake_run(cmd, cwd, check, stdout, stderr):
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

  monkeypatch.setattr(bp.subprocess, "run", fake_run)
  args = argparse.Namespace(workdir=str(tmp_path), method="disa", seeds=2, steps=150, skip=1)
  b = bp.run_block(args, "inproc", 0)
  assert seen[0][1:3] == ["-m", "launch.main"]
  assert "--config.engine.separate_process=False" in seen[0]
  assert {"--config.methods=('disa',)", "--config.seeds=(0,1,)",
          "--config.train.total_steps=150"} <= set(seen[0])
  assert b["median_run_s"] == 22.0 and b["median_step_s"] == pytest.approx(0.2)
  assert not (tmp_path / "blocks" / "inproc_0" / "stage3").exists()  # removed after reading
