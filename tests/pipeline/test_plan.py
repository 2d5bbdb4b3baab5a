"""`pipeline.plan`: the job as its analysis reads it. Run identity is data (names, seeds, rows,
directories and regimes resolved from the config), the claims' roles are declared in the config,
never parsed from run names, and a run's train overrides are one mapping of dotted paths that the
config's per-run keys declare."""
import dataclasses
import json

import pytest

from configs import main as main_config
from disa_jax import codec
from disa_jax.anchor import AnchorFitConfig
from disa_jax.pipeline import claims as C
from disa_jax.pipeline import report, tables
from disa_jax.pipeline.anchor_study import SigmaStudy, StudyVerdict
from disa_jax.pipeline.job_config import MainConfig, RunSpec, _is_replica, replace_paths
from disa_jax.pipeline.plan import job_plan, replica_units
from disa_jax.pipeline.sum_job import SumJob
from disa_jax.rl.objectives import Disa

# preset -> (DISA, its oracle): the declared runs (`MainConfig.disa`, ``oracle``) when they are in
# the preset's methods; the roles every preset's report played before issue 46 (it looked them up
# by the names 'disa' / 'disa_exact'), so that every report regenerates identical.
ROLES = {"": ("disa", "disa_exact"), "claims": ("disa", "disa_exact"),
         "claims_quick": ("disa", "disa_exact"), "replay_study": ("disa", ""),
         "anchor_study_rl": ("", ""), "anchor_study_rl_mean": ("", ""),
         "anchor_study_rl_quick": ("", ""), "nonuniform_target": ("disa", "disa_exact"),
         "staleness_study": ("", ""), "anchor_testbed": ("disa", "disa_exact"),
         "anchor_testbed_rl": ("disa", "disa_exact"),
         "anchor_testbed_rl_quick": ("disa", "disa_exact"),
         "anchor_testbed_offpolicy_pilot": ("", ""), "anchor_testbed_offpolicy": ("", ""),
         "anchor_testbed_offpolicy_mean": ("", ""), "coupling_pilot": ("", ""),
         "coupling_offpolicy": ("", ""), "coupling_offpolicy_quick": ("", ""),
         "coupling_onpolicy": ("", ""), "coupling_onpolicy_quick": ("", "")}


def _plan(c, workdir="/tmp/unused"):
  return job_plan(MainConfig.from_config(c), workdir)


@pytest.mark.parametrize("preset", main_config.PRESETS)
def test_the_roles_of_every_preset(preset):
  assert set(ROLES) == set(main_config.PRESETS)
  plan = _plan(main_config.get_config(preset))
  assert (plan.disa, plan.oracle) == ROLES[preset]


def test_the_roles_are_declared_not_parsed_from_names():
  c = main_config.get_config("claims_quick")
  c.runs.tb_fitted, c.runs.tb_exact = c.runs.disa, c.runs.disa_exact
  c.methods = ("disa_pos_replay", "tb_fitted", "tb_exact", "grpo")
  assert (_plan(c).disa, _plan(c).oracle) == ("", "")  # the declared runs are not trained
  c.disa, c.oracle = "tb_fitted", "tb_exact"
  plan = _plan(c)
  assert (plan.disa, plan.oracle, plan.fix) == ("tb_fitted", "tb_exact", "disa_pos_replay")
  c.oracle = "no_such_run"
  with pytest.raises(ValueError, match="oracle must name one of runs .* got 'no_such_run'"):
    _plan(c)
  c = main_config.get_config("claims")
  c.methods = ("disa_data1", "disa_matched", "disa_exact_pos_replay", "grpo")
  c.fix, c.controls, c.compare = "", (), ()
  plan = _plan(c)  # another Stage 1/2 draw, matched rows, replay: none of them is a role
  assert (plan.disa, plan.oracle) == ("", "")
  assert [r for r in plan.runs if plan.runs[r].maximises_reward] == ["grpo"]


def test_the_claims_take_their_roles_from_the_plan():
  rows = lambda vals: [(s, {"kl_decomposed": v, "kl_decomposed_se": 0.01, "entropy_correct": 1.7,
                            "target_entropy_correct": 1.84}) for s, v in enumerate(vals)]
  ev = C.Evidence(seed_rows={"tb": rows([0.3, 0.31, 0.29]), "oracle": rows([0.3, 0.3, 0.31])})
  plan = C.Plan(fix="", disa="tb", oracle="oracle", contrasts=(), controls=(), compare=(),
                replay=())
  out = C.build_claims(ev, plan, None)
  assert [c.claim.split(" (")[0] for c in out] == [
      "tb ends as close to the target as the oracle oracle"]
  assert C.build_claims(ev, dataclasses.replace(plan, oracle=""), None) == []


def test_each_run_is_data_its_rows_directories_and_regime(tmp_path):
  plan = _plan(main_config.get_config("claims"), tmp_path)
  disa = plan.runs["disa"]
  assert disa.seeds == (0, 1, 2, 3, 4) and disa.rows == ("disa",) + tuple(
      f"disa_seed{s}" for s in range(1, 5))
  assert disa.dir(2) == tmp_path / "stage3" / "disa_seed2" and disa.row(0) == "disa"
  assert (disa.objective, disa.anchor, disa.data_seed, disa.replay) == ("disa", "fitted", 0, False)
  assert plan.runs["disa_pos_replay_data1"].data_seed == 1 and plan.runs["disa_pos_replay"].replay
  assert plan.runs["disa_matched"].match_rows_of == "disa_pos_replay"
  assert disa.regime.label == "sum, 2 updates per batch" and disa.total_steps == 800
  assert disa.lr_decay_step is None  # (the small task's lr is constant)
  job = SumJob(MainConfig.from_config(main_config.get_config("claims")), tmp_path, progress=False)
  assert {k: c.workdir for k, c in job.stage3_cfgs.items()} == {
      (m, s): str(r.dir(s)) for m, r in plan.runs.items() for s in r.seeds}
  assert job.plan == plan and job.run_name("grpo", 2) == "grpo_seed2"


def test_the_regime_is_read_from_the_resolved_train_section():
  plan = _plan(main_config.get_config("staleness_study"))
  labels = {m: r.regime.label for m, r in plan.runs.items()}
  assert labels["k0_disa"] == "sum, 2 updates per batch"
  assert labels["k2_disa"] == "sum, 2 updates per batch, staleness 2"
  assert labels["k2_disa_halflr"] == "sum, 2 updates per batch, staleness 2, lr 0.00025"
  assert labels["k0_grpo"] == "-, 2 updates per batch"  # (no residual scale)
  grid = _plan(main_config.get_config("anchor_study_rl_mean"))
  assert grid.runs["mean_u4_fitted"].regime.label == "mean, 4 updates per batch"
  base = _plan(main_config.get_config("replay_study"))  # the base train section's schedule
  assert base.runs["disa"].lr_decay_step == 340  # the last 15% of 400 steps x 2 updates
  assert _plan(main_config.get_config()).runs["disa"].lr_decay_step is None  # constant lr


def test_a_runs_train_keys_are_one_mapping_of_dotted_paths():
  c = main_config.get_config("staleness_study")
  cfg = MainConfig.from_config(c)
  assert cfg.runs["k2_disa_halflr"].overrides == {"train.rollout.max_staleness": 2,
                                                  "train.optim.lr": main_config.HALF_LR}
  assert cfg.runs["k0_disa"].overrides == {}  # 0 keeps the job's
  # the same run declared by its mapping (a dict config, e.g. a printed one) trains the same
  raw = c.to_dict()
  spec = raw["runs"]["k2_disa_halflr"]
  for key in ("staleness", "lr", "minibatches"):
    del spec[key]
  spec["overrides"] = {"train.rollout.max_staleness": 2, "train.optim.lr": main_config.HALF_LR}
  raw["runs"]["k2_disa"]["overrides"] = {"train.optim.lr": 1}  # (an int for a float: 1.0)
  again = MainConfig.from_config(raw)
  assert again.runs["k2_disa_halflr"] == cfg.runs["k2_disa_halflr"]
  assert again.run_train("k2_disa_halflr", 1) == cfg.run_train("k2_disa_halflr", 1)
  assert again.runs["k2_disa"].overrides == {"train.rollout.max_staleness": 2, "train.optim.lr": 1.0}
  assert type(again.run_train("k2_disa", 0).optim.lr) is float
  raw["runs"]["k2_disa"]["overrides"] = {"train.rollout.max_staleness": 1}
  with pytest.raises(ValueError, match=r"runs.k2_disa: staleness=2 and "
                                       r"overrides\['train.rollout.max_staleness'\] set one field"):
    MainConfig.from_config(raw)
  train = cfg.run_train("k2_disa_halflr", 1)
  assert (train.rollout.max_staleness, train.optim.lr, train.seed) == (2, main_config.HALF_LR, 1)
  assert train.rollout.num_minibatches == cfg.train.rollout.num_minibatches


@pytest.mark.parametrize("overrides,match", [
    ({"train.rollout.num_minibatchs": 4}, "the train section has no field "
                                          "'train.rollout.num_minibatchs'"),
    ({"train.rollout": 4}, "'train.rollout' is a section, not a field"),
    ({"train.seed": 4}, "not train.objective, train.replay, train.seed"),
    ({"stage1.beta": 4.0}, "is not a field of the train section a run may override"),
    ({"train.rollout.num_minibatches": 2.5}, r"overrides\['train.rollout.num_minibatches'\] must "
                                             "be int, got 2.5"),
    ({"train.optim.lr": float("nan")}, r"overrides\['train.optim.lr'\] must be float \(finite\), "
                                       "got nan"),
    ({"train.optim.lr": 1}, r"overrides\['train.optim.lr'\] must be float \(finite\), got 1$")])
def test_an_override_of_no_train_field_is_refused_naming_it(overrides, match):
  with pytest.raises(ValueError, match=match):
    RunSpec(objective=Disa(), overrides=overrides)


def test_replace_paths_replaces_each_section_once():
  cfg = MainConfig.from_config(main_config.get_config())
  t = cfg.train
  got = replace_paths(t, {"seed": 3, "rollout.group_size": 12, "rollout.max_staleness": 1,
                          "optim.lr": 1e-4})
  assert got == dataclasses.replace(
      t, seed=3, rollout=dataclasses.replace(t.rollout, group_size=12, max_staleness=1),
      optim=dataclasses.replace(t.optim, lr=1e-4))


def test_the_anchor_study_is_passed_in_memory_and_read_only_when_resumed(tmp_path):
  c = main_config.get_config()
  c.anchor_study.repeats = 0
  job = SumJob(MainConfig.from_config(c), tmp_path, progress=False)
  assert job.anchor_study(None, None) is None  # off, never run
  saved = SigmaStudy(ns=(2, 4), folds=3, repeats=2, seed=0, floor=0.1, fit=AnchorFitConfig(),
                     rows=(), constant_sigma_g_mean=(1.0, 0.9), exact_std=1.5,
                     pool_label_rmse=0.4, pool_size=8, seconds=1.0,
                     verdict=StudyVerdict(verdicts={}, text="-", best=()))
  (tmp_path / "anchor_study.json").write_text(json.dumps(codec.encode(saved)))
  assert job.anchor_study(None, None) == saved  # a resumed job: the file its first run wrote


def _row(kl, **over):
  return {"k": 8, "accuracy_mean_at_k": 0.9, "distinct_correct_mean": 3.25, "p_correct_exact": 0.95,
          "entropy_correct": 1.5, "target_entropy_correct": 1.84, "kl_decomposed": kl,
          "kl_decomposed_se": 0.004, "kl_to_target": kl + 0.01, "kl_to_target_se": 0.008,
          "kl_binary": 0.01, "p_correct_kl_correct": 0.1, "p_wrong_kl_wrong": 0.02} | over


def test_report_md_and_the_docs_draw_the_methods_table_with_one_renderer():
  report = {"instrument": {"primary_metric": "kl_decomposed"},
            "regime": {"per_method": {"disa": "end state (flat)"}},
            "methods": {"reference": _row(0.5), "disa": _row(0.2, kl_decomposed_std=0.01,
                                                             kl_to_target_std=0.02, seeds=2)},
            "skipped_methods": {"lora_sft": "no Stage 1 sample has reward 1"}}
  full = tables.methods_table(tables.read(report), every_row=True)
  docs = tables.methods_table(tables.read(report))
  assert full[0] == ("| method | state | Mean@8 | distinct correct in 8 | P(correct) | entropy "
                     "over correct (target) | KL(pi ‖ pi~), decomposed | KL, Monte Carlo | KL "
                     "binary | P_c KL_c | P_w KL_w |")
  assert full[2:] == [
      "| reference | - | 0.900 | 3.25 | 0.950 | 1.50 (1.84) | 0.500 ± 0.004 | 0.510 ± 0.008 | "
      "0.010 | 0.100 | 0.020 |",
      "| disa (2 seeds) | end state (flat) | 0.900 | 3.25 | 0.950 | 1.50 (1.84) | 0.200 ± 0.010 | "
      "0.210 ± 0.020 | 0.010 | 0.100 | 0.020 |",
      "| lora_sft | not trained: no Stage 1 sample has reward 1 | | | | | | | | | |"]
  assert docs[2:] == ["| `disa` | 2 | end state (flat) | 0.950 | 1.50 (1.84) | 0.200 ± 0.010 | "
                      "0.210 ± 0.020 |"]  # the Stage 3 methods alone


def test_anchor_replicas_draw_their_own_stage12_with_the_stage3_seeds_nested(tmp_path):
  """Issue 62: with anchor_replicas R every run reading the Stage 1/2 draw (the fitted anchor, the
  'exact+noise' offsets) is a cell run on R replicas, each its own Stage 1 sampling seed, Stage 2
  fit seed and noise draw, the same Stage 3 seeds within each; the other runs are not replicated."""
  c = main_config.get_config("anchor_testbed_rl")
  c.anchor_replicas = 3
  for cell in ("disa", "disa_noise025", "disa_noise1"):
    c.runs[cell].seeds = ()  # (the preset runs them at seed 0 alone: here the job's seeds nest)
  cfg = MainConfig.from_config(c)
  plan = job_plan(cfg, tmp_path)
  cells = ("disa", "disa_noise025", "disa_noise1")
  assert plan.replicas == {m: (m, f"{m}_rep1", f"{m}_rep2") for m in cells}
  assert [plan.runs[r].data_seed for r in plan.replicas["disa"]] == [0, 1, 2]
  assert {plan.runs[r].cell for r in plan.replicas["disa"]} == {"disa"}
  assert plan.runs["disa_exact"].cell == "disa_exact" and "disa_exact_rep1" not in plan.runs
  for r in plan.replicas["disa_noise1"]:
    assert plan.runs[r].seeds == cfg.seeds == main_config.TESTBED_SEEDS  # nested in each replica
  assert dataclasses.replace(cfg) == cfg and MainConfig.from_config(c).methods == cfg.methods
  job = SumJob(cfg, tmp_path, progress=False)
  s1 = {d: s.sampling.seed for d, (s, _) in job.replicas.items()}
  fits = {d: s.fit.seed for d, (_, s) in job.replicas.items()}
  assert sorted(s1) == [0, 1, 2] and len(set(s1.values())) == len(set(fits.values())) == 3
  anchors = {r: job.stage3_cfgs[(r, 0)].data.anchor_path for c in cells for r in plan.replicas[c]}
  assert len(set(anchors.values())) == 9  # a fitted anchor and two noise draws per replica
  tracks = {job.stage3_cfgs[(r, 1)].exact_target.seed for r in plan.replicas["disa"]}
  assert len(tracks) == 3  # independent measurement streams for the same Stage 3 seed
  c.anchor_replicas = 0
  with pytest.raises(ValueError, match="anchor_replicas must be an int >= 1, got 0"):
    MainConfig.from_config(c)


def test_the_anchor_claims_unit_is_the_replica_mean():
  c = main_config.get_config("anchor_testbed_rl")
  c.anchor_replicas, c.seeds, c.runs.disa.seeds = 3, (0, 1), ()
  plan = _plan(c)
  values = {row: float(i) for i, row in enumerate(r for run in plan.runs.values() for r in run.rows)}
  units = replica_units(plan, values)
  rows = {r: plan.runs[r].rows for r in plan.runs}
  assert units["disa"] == [sum(values[x] for x in rows[r]) / 2 for r in plan.replicas["disa"]]
  assert units["disa_exact"] == [values[x] for x in rows["disa_exact"]]  # its seeds
  assert "disa_rep1" not in units and list(units)[0] == "disa_exact"
  rows = {row: {k: v for k in ("kl_decomposed", "kl_to_target", "kl_correct", "p_correct_exact")}
          for row, v in values.items()}
  assert report._replica_units(plan, rows)["kl_decomposed"] == units  # (report.json's section)
  del values[plan.runs["disa_rep2"].rows[1]]
  with pytest.raises(KeyError, match="no value for row 'disa_rep2_seed1'"):
    replica_units(plan, values)


def test_a_claim_about_a_replicated_cell_is_decided_over_its_anchor_replicas():
  """Issue 62 (item 5): in the staleness study the fitted anchor's cells run on 5 Stage 1-2
  replicas x 1 seed; 'k0_disa_exact<k0_disa' compares the exact log Z's 5 seeds with the 5 anchors,
  not with one anchor's seeds. A replicated cell a claim names with 2 seeds per replica raises."""
  plan = _plan(main_config.get_config("staleness_study"))
  assert plan.replicas["k0_disa"] == ("k0_disa", *(f"k0_disa_rep{d}" for d in range(1, 5)))
  rows = {m: [(s, {"kl": float(i * 10 + s)}) for s in r.seeds]
          for i, (m, r) in enumerate(plan.runs.items())}
  ends = report.Dynamics(series={}, ends={}, states={}, matched_runs={})
  roles = C.Plan(fix="", disa="", oracle="", contrasts=(), controls=(),
                 compare=plan.compare, replay=())
  units, _, _ = report._replica_claim_units(plan, roles, rows, ends)
  assert [r["kl"] for _, r in units["k0_disa"]] == [rows[n][0][1]["kl"]
                                                    for n in plan.replicas["k0_disa"]]
  assert [d for d, _ in units["k0_disa"]] == [0, 1, 2, 3, 4]
  assert units["k0_disa_exact"] == rows["k0_disa_exact"]  # a cell without replicas: its seeds
  c = main_config.get_config("staleness_study")
  c.runs.k0_disa.seeds = (0, 1)
  with pytest.raises(ValueError, match="cell 'k0_disa' is named in a claim"):
    report._replica_claim_units(_plan(c), roles, rows, ends)


@pytest.mark.parametrize("preset", ["", "anchor_testbed_rl", "anchor_testbed_offpolicy",
                                    "anchor_testbed_offpolicy_mean", "staleness_study",
                                    "coupling_onpolicy", "coupling_offpolicy"])
def test_every_cell_that_reads_the_stage12_draw_runs_on_at_least_three_anchors(preset):
  """Issue 62 (item 5): in every multi-seed preset whose claims compare a fitted anchor (or an
  offset drawn with it), each such cell runs on >= 3 independent Stage 1-2 replicas."""
  cfg = MainConfig.from_config(main_config.get_config(preset))
  cells = [m for m in cfg.methods if cfg.runs[m].reads_stage12 and not _is_replica(m)]
  assert cells and cfg.anchor_replicas >= 3
  assert set(cfg.replicated()) == set(cells)
  for m in cells:
    assert len(cfg.replicated()[m]) == cfg.anchor_replicas
  assert len({cfg.run_seeds(m) for m in cfg.methods if m not in cells and not _is_replica(m)}) == 1
