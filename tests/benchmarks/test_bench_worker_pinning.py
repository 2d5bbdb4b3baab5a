"""benchmarks/bench_worker_pinning.py's pieces on the main job's own Stage 3 config: the two copies
it trains, and what it compares between pinned and unpinned runs."""
import json

from disa_jax import codec
from tests.benchmarks.scripts import load

bp = load("bench_worker_pinning")


def test_two_copies_of_the_jobs_run_cut_to_the_steps(tmp_path):
  from tests.test_main_job import _cfg, _job
  job = _job(_cfg(methods=("disa",)), tmp_path / "job")
  cfg = job.stage3_cfgs[("disa", 0)]
  (tmp_path / "job" / "stage3" / "disa").mkdir(parents=True)
  codec.save(cfg, tmp_path / "job" / "stage3" / "disa" / "config.json")
  a, b = bp.run_configs(tmp_path / "job", "disa", 7, tmp_path / "out")
  assert (a.workdir, b.workdir) == (str(tmp_path / "out" / "a"), str(tmp_path / "out" / "b"))
  assert a.train.total_steps == b.train.total_steps == 7 and not a.train.progress_bar
  assert a.train.seed == cfg.train.seed and a.train.objective == cfg.train.objective
  assert a.exact_target == cfg.exact_target and a.data == cfg.data


def test_runs_are_compared_without_their_timings(tmp_path):
  rows = [{"step": 0, "exact/kl": 1.5}, {"step": 1, "loss": 2.0, "time/step_s": 0.1,
                                         "tokens_per_s": 9.0},
          {"step": 2, "loss": 1.0, "time/step_s": 0.3}, {"step": 3, "loss": 0.5, "time/step_s": 0.2}]
  (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  assert bp.metrics(str(tmp_path)) == [{"step": 0, "exact/kl": 1.5}, {"step": 1, "loss": 2.0},
                                       {"step": 2, "loss": 1.0}, {"step": 3, "loss": 0.5}]
  assert bp.step_median(str(tmp_path), skip=1) == 0.25  # steps 2 and 3
