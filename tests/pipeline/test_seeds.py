"""`pipeline.seeds`: every seed the main job (and the offline job, and a warm-up) draws comes from
one table (issue 46: no offset written anywhere else), with the values the committed reports were
drawn with, and per-run streams that differ between runs and Stage 3 seeds."""
import re
from pathlib import Path

import pytest

from disa_jax.pipeline import seeds

PIPELINE = Path(seeds.__file__).parent


def test_the_job_streams_keep_the_offsets_the_reports_were_drawn_with():
  assert {k: v[0] for k, v in seeds.JOB_STREAMS.items()} == {
      "stage2_fit": 0, "nstudy": 0, "anchor_study": 0, "noise_anchor": 0, "sft": 0, "n_study": 11,
      "offline_pool": 2, "offline_n_study": 1, "warmup_data": 1}
  assert seeds.job_seed(5, "n_study") == 16 and seeds.job_seed(5, "stage2_fit", d=2) == 7
  with pytest.raises(KeyError, match="unknown job seed stream 'nope'"):
    seeds.job_seed(0, "nope")


def test_run_streams_differ_by_run_and_stage3_seed_and_are_stable():
  got = {(run, s): seeds.run_seed(0, "track", run, s) for run in ("disa", "grpo") for s in (0, 1)}
  assert len(set(got.values())) == 4 and all(0 <= v < 2**31 for v in got.values())
  assert seeds.run_seed(0, "track", "disa", 0) == seeds.run_seed(0, "track", "disa", 0)
  assert seeds.run_seed(0, "eval_sampling", "reference", None) != seeds.run_seed(
      0, "eval_exact", "reference", None)
  with pytest.raises(ValueError, match="stage3_seed must be >= 0"):
    seeds.run_seed(0, "track", "disa", -1)
  with pytest.raises(KeyError, match="unknown run seed stream 'nope'"):
    seeds.run_seed(0, "nope", "disa", 0)


def test_no_pipeline_module_adds_its_own_seed_offset():
  """``<...>seed + <int>`` outside seeds.py would be an offset the table does not list."""
  offset = re.compile(r"seed\)?\s*[+-]\s*\d")
  found = [f"{p.name}:{i}: {line.strip()}" for p in sorted(PIPELINE.glob("*.py"))
           if p.name != "seeds.py"
           for i, line in enumerate(p.read_text().splitlines(), 1) if offset.search(line)]
  assert not found, found
