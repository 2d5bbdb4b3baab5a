"""The claims preset trains the fix's controls as named runs, each differing from the fix in one
thing, and the config refuses controls it cannot build."""
import dataclasses
import re

import pytest

from configs import main as main_config
from disa_jax.pipeline.sum_job import MainConfig, SumJob

CONTROLS = ("disa_exact_pos_replay", "disa_matched", "disa_pos_replay_n8", "replay_sft",
            "grpo_remedies")


@pytest.fixture(scope="module")
def job(tmp_path_factory):
  return SumJob(MainConfig.from_config(main_config.get_config("claims")),
                tmp_path_factory.mktemp("claims"), progress=False)


def _train(job, method):
  return job.stage3_cfgs[(method, 0)].train


def test_every_control_is_a_named_run_of_the_claims_preset(job):
  assert job.cfg.controls == CONTROLS and set(CONTROLS) <= set(job.cfg.methods)
  fix = _train(job, "disa_pos_replay")
  g, k = fix.rollout.group_size, fix.replay_rows
  assert (g, k) == (8, 4)
  # the fix on the exact log Z: the fix's replay, the oracle's anchor
  exact = job.stage3_cfgs[("disa_exact_pos_replay", 0)]
  assert exact.train.replay == fix.replay and exact.data.anchor_path == job.exact_anchor_path
  # compute-matched on-policy DISA: G + k on-policy rows per prompt, no replay
  matched = _train(job, "disa_matched")
  assert matched.rollout.group_size == g + k and not matched.replay.enabled
  assert matched.rows_per_prompt == fix.rows_per_prompt
  # the fix on the N label samples only
  n8 = _train(job, "disa_pos_replay_n8")
  assert n8.replay.first_samples == job.stage2_cfg.samples == 8
  assert n8.replay == dataclasses.replace(fix.replay, first_samples=8)
  # SFT on the same replay rows, same steps
  sft = _train(job, "replay_sft")
  assert sft.objective.name == "replay_sft" and sft.replay == fix.replay
  assert sft.total_steps == fix.total_steps
  # GRPO with clip-higher and KL-Cov
  grpo = _train(job, "grpo_remedies").objective
  assert (grpo.eps_low, grpo.eps_high) == (0.2, 0.28) and grpo.kl_cov_ratio > 0


def test_controls_the_config_cannot_build_are_refused():
  c = main_config.get_config("claims")
  c.controls = ("disa_pos_replay",)
  with pytest.raises(ValueError, match="controls must name runs .* other than the fix"):
    MainConfig.from_config(c)
  c = main_config.get_config("claims")
  c.runs.disa_matched.match_rows_of = "disa"  # no 'add' replay to match
  with pytest.raises(ValueError, match="runs.disa_matched.match_rows_of must name a run with "
                                       "replay mode 'add', got 'disa'"):
    MainConfig.from_config(c)
  c = main_config.get_config("claims")
  c.runs.disa_pos_replay_n8.match_rows_of = "disa_pos_replay"
  with pytest.raises(ValueError, match="samples every row on-policy, but the run replays"):
    MainConfig.from_config(c)


@pytest.mark.parametrize("pair", ["disa<nope", "disa<disa", "disa>grpo", "disa"])
def test_a_comparison_of_runs_the_job_does_not_train_is_refused(pair):
  c = main_config.get_config("")
  c.compare = (pair,)
  with pytest.raises(ValueError, match=r"compare\[0\] must be 'A<B' .*" + re.escape(repr(pair))):
    MainConfig.from_config(c)


def test_the_staleness_study_compares_runs_it_trains():
  cfg = MainConfig.from_config(main_config.get_config("staleness_study"))
  assert "k2_disa<k2_flowrl" in cfg.compare and "k0_disa<k2_disa" in cfg.compare
  assert all(set(p.split("<")) <= set(cfg.methods) for p in cfg.compare)
