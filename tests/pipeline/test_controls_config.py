"""The claims preset trains the fix's controls as named runs, each differing from the fix in one
thing, and the config refuses controls it cannot build."""
import dataclasses
import re

import pytest

from configs import main as main_config
from disa_jax.pipeline.job_config import MainConfig
from disa_jax.pipeline.sum_job import SumJob

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


def test_the_claims_preset_runs_the_decisive_runs_on_five_seeds_and_the_rest_on_three(job):
  seeds = {m: job.cfg.run_seeds(m) for m in job.cfg.methods}
  assert {m for m, s in seeds.items() if len(s) == 5} == set(main_config.CLAIMS_DECISIVE)
  assert all(len(s) == 3 for m, s in seeds.items() if m not in main_config.CLAIMS_DECISIVE)
  assert len(job.stage3_cfgs) == 41
  # the small task at a constant lr: no decay phase inside the end-state window
  train = _train(job, "disa")
  assert (job.task.n_max, train.optim.decay_frac, train.total_steps) == (15, 0.0, 800)
  assert job.stage3_cfgs[("disa", 4)].train.seed == 4


def test_a_data_seed_reads_its_own_stage1_draw_and_anchor_fit(job):
  assert sorted(job.replicas) == [0, 1]
  (s1, s2), (r1, r2) = job.replicas[0], job.replicas[1]
  # another draw of Stage 1 (its own file and sampling seed), another fit of Stage 2 on it
  assert r1.sampling == dataclasses.replace(s1.sampling, seed=s1.sampling.seed + 1)
  assert r1.dataset_path() != s1.dataset_path() and r2.stage1_path == str(r1.dataset_path())
  assert r2.fit == dataclasses.replace(s2.fit, seed=s2.fit.seed + 1)
  assert len({s2.anchor_path, r2.anchor_path, s2.output_dir, r2.output_dir}) == 4
  for name, anchor, pool in (("disa_pos_replay", s2.anchor_path, s1.dataset_path()),
                             ("disa_pos_replay_data1", r2.anchor_path, r1.dataset_path())):
    for seed in (0, 1):
      data = job.stage3_cfgs[(name, seed)].data
      assert (data.anchor_path, data.replay_path) == (anchor, str(pool)), name
  assert job.stage3_cfgs[("disa_data1", 0)].data.anchor_path == r2.anchor_path
  # otherwise the same run: the replica changes nothing but the data
  assert _train(job, "disa_pos_replay_data1") == _train(job, "disa_pos_replay")
  assert "disa_pos_replay_data1<disa_data1" in job.cfg.compare


def test_a_negative_data_seed_is_refused():
  c = main_config.get_config("claims")
  c.runs.disa_data1.data_seed = -1
  with pytest.raises(ValueError, match=r"runs.disa_data1.*data_seed must be an int >= 0 .*got -1"):
    MainConfig.from_config(c)


def test_claims_quick_is_one_seed_of_the_four_claims_runs_as_the_claims_preset_trains_them(job):
  quick = SumJob(MainConfig.from_config(main_config.get_config("claims_quick")), job.dir / "q",
                 progress=False)
  assert set(quick.stage3_cfgs) == {(m, 0) for m in ("disa_pos_replay", "disa", "disa_exact", "grpo")}
  for (m, _), cfg in quick.stage3_cfgs.items():
    assert cfg.train == _train(job, m), m


def test_replay_pairs_come_from_the_run_specs_not_their_names():
  """Issue 9's replay comparisons: a run replacing slots by Stage 1 samples against the same run
  without replay, found by its `RunSpec` (the pairs the '_replay' names gave on every preset, and
  the same pair under other names); 'add' mode (the fix) and other objectives are no pair."""
  from disa_jax.pipeline.plan import replay_pairs
  cfg = MainConfig.from_config(main_config.get_config("replay_study"))
  assert replay_pairs(cfg.runs, cfg.methods) == (("disa_replay", "disa"), ("flowrl_replay", "flowrl"))
  runs = {"mixed": cfg.runs["disa_replay"], "plain": cfg.runs["disa"],
          "fix": cfg.runs["disa_pos_replay"], "head": cfg.runs["flowrl"]}
  assert replay_pairs(runs, tuple(runs)) == (("mixed", "plain"),)
  assert replay_pairs(runs, ("fix", "plain", "head")) == ()
