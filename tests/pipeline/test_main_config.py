"""The main job's config converts once: `MainConfig` holds typed workflow sections, and the config
of every stage (each Stage 3 run per method and seed above all) is derived from them with
`dataclasses.replace`, identical to what the job built before (by merging raw dicts and converting
each section a second time) for every preset of configs/main.py."""
import dataclasses
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from configs import main as main_config
from disa_jax import config as config_lib
from disa_jax.pipeline import report
from disa_jax.pipeline.job_config import JOB_PATH, MainConfig
from disa_jax.pipeline.sum_job import SumJob
from disa_jax.rl.config import TrainConfig
from disa_jax.sft.baseline import LoRASFTConfig
from disa_jax.workflows.evaluation import EvalConfig
from disa_jax.workflows.stage1 import Stage1Config
from disa_jax.workflows.stage2 import Stage2Config

# Written by the job of commit 1974253 (raw dict sections merged by hand, converted per stage):
# per preset and heldout fraction, the sha256 (16 hex digits) of every stage config's JSON form
# (`config_lib.to_dict`, keys sorted, the workdir written '<workdir>'), and the default preset's
# configs in full. The staleness preset's k2_vargrad runs were added later (their hashes written
# by the new code, with every older entry of that preset checked unchanged first). The regime grid
# and non-uniform target presets moved to the small task later (issue 27): their entries were
# rewritten by the new code (and the one-seed subset anchor_study_rl_quick added), every other
# preset's checked unchanged. Issue 44 rewrote every entry: each run's own tracking and evaluation
# seeds (`pipeline.seeds`) and the end-state presets' tracking (every 16 / 20 steps, 32 samples);
# reverting exactly those fields (and the attention_impl / remat_policy fields added meanwhile) gave
# every committed hash back first. The engine's process.copy_threads (issue 41) was added the same
# way: dropping exactly that field gave every committed hash back before the new ones were written.
# So was the engine's push_bucket_bytes (issue 41), and Stage 2's exclude_prompts_path (issue 45),
# before the anchor_testbed preset's entries were added; and the exact tracker's heldout_path
# (issue 45), before the anchor_testbed_rl presets' entries were added. The exact tracker's
# wrong_samples (issue 44: 32 / 64 in the default and testbed presets, 0 in those with committed
# reports) likewise: dropping exactly that field gave every committed hash back first; since
# `config.to_dict` leaves it out while it is 0 (its codec ``omit``), the presets that pin 0 hash
# exactly as in the fixture before the field existed (checked against that version first). The
# default preset became the decisive job of issue 44 (`_decisive_default`): its entries were
# rewritten after every other preset's were checked unchanged. The anchor_testbed_rl presets' entries
# were rewritten for their 600-step budget tracked every 40 in the run's process (issue 45's
# rebuilt testbed) after every other preset's were checked unchanged, and the
# anchor_testbed_offpolicy_pilot preset's entries were added. The exact tracker's share_prompts and
# wrong_decode (recorded only where set) left every preset's hash unchanged; then the three
# testbed Stage 3 presets, which set them, had their hashes rewritten. The off-policy presets'
# (anchor_testbed_offpolicy, _mean) entries were added with every other entry unchanged.
# The staleness study's seeds 3 and 4 (issue 45: five seeds) were added the same way: its seeds
# 0-2 and every other preset's entries unchanged.
# Issue 62's dense start of the testbed's Stage 3 presets (validation.at_start, early_every,
# dense_from): with exactly those fields reverted every entry hashed as committed; then the five
# testbed Stage 3 presets' entries were rewritten, every other preset's unchanged. Issue 62 added
# FlowRL as the paper runs it (flowrl_paper, 5 seeds) to the default preset and moved its tracker
# and evaluation to the cheaper implementation (share_prompts, wrong_decode 'cached'): with the
# tracker's fields reverted only the flowrl_paper entries were new; then the default preset's
# entries were rewritten, every other preset's checked unchanged.
# Issue 62's dense start of the default preset (validation.at_start, start_every, start_until): only
# its 25 Stage 3 entries changed (with those fields reverted they hashed as before).
# Issue 62's tracker scorer rows (track.scorer_rows / eval.exact_target.scorer_rows = 8 in the default
# preset, recorded only where set): the diff of the default preset's entries is that field alone,
# every other preset's entries hashed as committed; then the default preset's entries were rewritten.
# Issue 63 added the coupling presets' entries (coupling_pilot, coupling_offpolicy(_quick), and after the
# pilot coupling_onpolicy(_quick)); every
# other entry checked unchanged.
# Issue 62 (item 5) ran the staleness study's fitted-anchor cells on 5 anchor replicas x 1 seed: its
# entries' diff is seeds 1-4 of k0_disa / k2_disa / k2_disa_halflr removed and their 12 replica
# runs added, every other entry (its own and every other preset's) hashed as committed. The same
# for anchor_testbed_rl (disa, disa_noise025, disa_noise1) and anchor_testbed_offpolicy(_mean)
# (u4_disa): 5 anchor replicas x seed 0 in place of seeds 1-4; and for the default preset
# (disa_pos_replay, disa), its full entries rewritten.
# Issue 64 made 'auto' the JAX sampler's default layout and had configs/main.py name 'ragged', the
# layout its reports were drawn on: 1,010 of the 1,090 entries gained engine.jax_kwargs.cache_layout
# = 'ragged'; with that field removed every entry hashed as committed; then all were rewritten.
FIXTURE = Path(__file__).parents[1] / "fixtures" / "pipeline" / "main_job_configs_1974253.json"


def _job(c, workdir) -> SumJob:
  return SumJob(MainConfig.from_config(c), workdir, progress=False)


def _stage_configs(job: SumJob, workdir: Path) -> dict[str, dict]:
  """{'<method>/<seed>' or '<stage1>' / '<stage2>' / '<sft>' / '<eval>': the config as JSON}."""
  cfgs = {f"{m}/{s}": c for (m, s), c in job.stage3_cfgs.items()}
  cfgs |= {"<stage1>": job.stage1_cfg, "<stage2>": job.stage2_cfg, "<sft>": job.sft_cfg,
           "<eval>": job.eval_template}
  text = {k: json.dumps(config_lib.to_dict(c), sort_keys=True).replace(str(workdir), "<workdir>")
          for k, c in cfgs.items()}
  return {k: json.loads(t) for k, t in text.items()}


def _sha(obj) -> str:
  return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


@pytest.mark.parametrize("preset", main_config.PRESETS)
def test_every_stage_config_of_every_preset_is_unchanged(tmp_path, preset):
  expected = json.loads(FIXTURE.read_text())
  for heldout in (0.0, 0.2):
    c = main_config.get_config(preset)
    c.heldout.fraction = heldout
    c.track.heldout = c.track.heldout and heldout > 0  # (held-out tracking needs held-out prompts)
    workdir = (tmp_path / f"h{heldout}").resolve()
    got = _stage_configs(_job(c, workdir), workdir)
    key = f"{preset or 'default'}/heldout{heldout}"
    if key in expected["full"]:  # (a diff to read if it fails)
      assert got == expected["full"][key]
    assert {k: _sha(v) for k, v in got.items()} == expected["sha256"][key], key


def test_sections_are_typed_and_each_stage_derives_from_them(tmp_path):
  c = main_config.get_config()
  c.train.total_steps = 50  # (as --config.train.total_steps=50 sets it)
  c.beta = 10.0
  cfg = MainConfig.from_config(c)
  assert isinstance(cfg.stage1, Stage1Config) and isinstance(cfg.stage2, Stage2Config)
  assert isinstance(cfg.train, TrainConfig) and isinstance(cfg.sft, LoRASFTConfig)
  assert isinstance(cfg.eval, EvalConfig) and cfg.stage1.prompts_path == JOB_PATH
  assert cfg.train.total_steps == 50 and cfg.sft.learning_rate == c.sft.learning_rate
  job = SumJob(cfg, tmp_path, progress=False)
  derived = [job.stage1_cfg, job.stage2_cfg, job.sft_cfg, job.eval_template,
             *job.stage3_cfgs.values()]
  assert JOB_PATH not in json.dumps([config_lib.to_dict(d) for d in derived])
  assert job.stage1_cfg.beta == job.eval_template.exact_target.beta == 10.0
  for (method, _), run in job.stage3_cfgs.items():
    assert run.train.total_steps == 50, method
    obj = run.train.objective
    assert getattr(obj, "beta", 10.0) == 10.0, method  # the job's beta, not the section's 15
    assert run.train.objective == dataclasses.replace(
        cfg.runs[method].objective, **({"beta": 10.0} if hasattr(obj, "beta") else {}))


@pytest.mark.parametrize("field,value,match", [
    ("train.total_steps", 0, r"train.total_steps must be >= 1, got 0"),
    ("train.rollout.group_size", 0, r"train.rollout.group_size must be >= 1, got 0"),
    ("runs.disa.objective.beta", -1.0, r"runs.disa.objective: beta must be > 0, got -1.0"),
    ("eval.rendering", "zz", r"eval: rendering must be one of .*, got 'zz'")])
def test_a_bad_section_field_stops_the_one_conversion_naming_it(field, value, match):
  c = main_config.get_config()
  *path, last = field.split(".")
  section = c
  for k in path:
    section = section[k]
  section[last] = value
  with pytest.raises(ValueError, match=match):
    MainConfig.from_config(c)


def test_a_run_override_the_train_section_refuses_names_the_run(tmp_path):
  c = main_config.get_config()
  c.runs.disa.minibatches = 3  # 8 prompts x 16 rows do not split into 3 mini-batches
  cfg = MainConfig.from_config(c)
  with pytest.raises(ValueError, match=r"runs.disa: rollout.num_minibatches must divide the 128 "
                                       r"rows of a step .* got 3"):
    SumJob(cfg, tmp_path, progress=False)


def test_the_report_reads_the_typed_train_section(tmp_path):
  c = main_config.get_config()
  c.train.total_steps = 50
  regime = report._regime(_job(c, tmp_path).plan,  # pylint: disable=protected-access
                          report.Dynamics(series={}, ends={}, states={}, matched_runs={}))
  assert regime.steps == 50 and not regime.all_at_end_state
  assert set(regime.per_method.values()) == {"undecided (no exact measurements)"}


def test_every_run_and_stage3_seed_measures_and_is_evaluated_with_its_own_seeds(tmp_path):
  job = _job(main_config.get_config("claims"), tmp_path)
  track = {k: c.exact_target.seed for k, c in job.stage3_cfgs.items()}
  assert len(set(track.values())) == len(track) == 41  # no two runs share a measurement's samples
  rows = ["reference", "proposal"] + list(job.run_of_row)
  evals = [job._eval_config(r, "m") for r in rows]  # pylint: disable=protected-access
  exact, sampling = [e.exact_target.seed for e in evals], [e.seed for e in evals]
  assert len(set(exact)) == len(set(sampling)) == len(rows)
  assert not set(exact) & set(sampling) and not set(exact) & set(track.values())
  assert job.stage3_cfgs[("disa", 1)].train.seed == 1  # training: the Stage 3 seed (seeds.py)
  again = _job(main_config.get_config("claims_quick"), tmp_path / "q")  # a run keeps its seeds
  assert again.stage3_cfgs[("disa", 0)].exact_target.seed == track[("disa", 0)]


# (the anchor testbed's Stage 3 presets decide by pre-registered endpoints, not end states: their
# measurements cost ~8 s each on 160 prompts' correct sets; its off-policy pilot picks a step size
# by the rule of docs/preregistration.md, "The off-policy part", issue 63's pilot likewise)
@pytest.mark.parametrize("preset", [p for p in main_config.PRESETS
                                    if p not in ("", "replay_study", "anchor_testbed_offpolicy_pilot",
                                                 "coupling_pilot")
                                    and main_config.get_config(p).stages == "all"
                                    and not main_config.get_config(p).endpoints.compare])
def test_every_preset_that_decides_end_states_has_enough_measurements_in_the_window(preset):
  from disa_jax.pipeline import dynamics
  cfg = MainConfig.from_config(main_config.get_config(preset))
  steps = np.arange(cfg.track.every, cfg.train.total_steps + 1, cfg.track.every)
  assert dynamics.window_mask(steps, cfg.end_state).sum() >= cfg.end_state.min_points, preset


def test_the_end_state_section_is_typed_and_a_pair_is_declared_once():
  c = main_config.get_config()
  c.end_state.delta_rel = 0.2
  assert MainConfig.from_config(c).end_state.delta(1.0) == pytest.approx(0.2)
  c.end_state.level = 1.5
  with pytest.raises(ValueError, match=r"end_state.level must be in \(0, 1\), got 1.5"):
    MainConfig.from_config(c)
  c = main_config.get_config()
  c.compare = ("disa<grpo", "grpo<>disa")
  with pytest.raises(ValueError, match=r"compare\[1\] = 'grpo<>disa' tests the pair of 'disa<grpo' "
                                       "again"):
    MainConfig.from_config(c)
  grid = MainConfig.from_config(main_config.get_config("anchor_study_rl"))
  pairs = [frozenset(p.replace("<>", "<").split("<")) for p in grid.compare]
  assert len(pairs) == len(set(pairs)) == 12  # (half of the 18 before: each pair in both directions)


def test_a_pool_without_a_correct_sample_skips_the_sft_baseline_with_its_reason(tmp_path):
  """No reward-1 Stage 1 sample: no LoRA-SFT row; the reason is recorded in sft_skipped.json and
  is the one the report's ``skipped_methods`` gives (`sum_job.SFT_SKIPPED`)."""
  from disa_jax.pipeline import sum_job
  job = _job(main_config.get_config(), tmp_path)
  pool = type("Pool", (), {"reward": np.zeros((3, 4)), "mask": np.ones((3, 4), bool)})()
  assert job.lora_sft(pool) is None
  saved = json.loads((tmp_path / "sft_skipped.json").read_text())
  assert saved == {"reason": sum_job.SFT_SKIPPED} == {"reason": "no Stage 1 sample has reward 1"}


def test_the_off_policy_pilot_runs_the_oracle_at_each_step_size_with_four_clipped_updates():
  cfg = MainConfig.from_config(main_config.get_config("anchor_testbed_offpolicy_pilot"))
  lrs = sorted(cfg.run_train(m, 0).optim.lr for m in cfg.methods)
  assert lrs == sorted(main_config.TESTBED_OFFPOLICY_LRS) and set(cfg.seeds) == {0}
  for m in cfg.methods:
    spec, train = cfg.runs[m], cfg.run_train(m, 0)
    assert spec.anchor == "exact" and train.rollout.num_minibatches == 4, m
    assert train.objective.omega == "clipped_ratio" and train.objective.scale == "sum", m


def test_the_testbed_presets_track_with_the_cheaper_tracker_and_others_with_the_reference(tmp_path):
  """track.share_prompts / track.wrong_decode / track.scorer_rows reach every Stage 3 run's exact
  target and the evaluation's own section its evaluations; the presets run before them keep the
  reference (the default job took the cheaper one with issue 62, and 8 scoring rows)."""
  for preset, want in (("anchor_testbed_rl", (True, "cached", 64)), ("", (True, "cached", 8)),
                       ("claims", (False, "full", 64))):
    job = _job(main_config.get_config(preset), tmp_path / (preset or "default"))
    for cfg in job.stage3_cfgs.values():
      et = cfg.exact_target
      assert (et.share_prompts, et.wrong_decode, et.scorer_rows) == want, preset
    et = job.eval_template.exact_target
    assert (et.share_prompts, et.wrong_decode, et.scorer_rows) == want, preset
  c = main_config.get_config("claims")
  c.track.wrong_decode = "kv"
  with pytest.raises(ValueError, match=r"track.wrong_decode must be one of \('full', 'cached'\), "
                                       "got 'kv'"):
    MainConfig.from_config(c)
  c = main_config.get_config("claims")
  c.track.scorer_rows = 0
  with pytest.raises(ValueError, match=r"track.scorer_rows must be >= 1, got 0"):
    MainConfig.from_config(c)
