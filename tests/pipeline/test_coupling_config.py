"""`configs/coupling.py`: issue 63's presets as docs/preregistration.md declares them (the cells, the
clip arms as a run's train override, the pilot's groups, the off-policy block's replicas)."""
import pytest

from configs import coupling
from configs import main as main_config
from disa_jax.pipeline import step_size as SZ
from disa_jax.pipeline.job_config import MainConfig
from disa_jax.rl.objectives import DisaCentred


def test_the_pilot_runs_every_cell_at_every_clip_and_lr_in_groups_of_three():
  cfg = MainConfig.from_config(main_config.get_config("coupling_pilot"))
  assert len(cfg.methods) == len(coupling.ONPOLICY_CELLS) * len(coupling.CLIPS) * 3 == 30
  groups = {}
  for name in cfg.methods:
    groups.setdefault(SZ.pilot_group(name), []).append(name)
  assert len(groups) == 10 and all(len(v) == 3 for v in groups.values())
  run = cfg.runs["disa_exact_centred_c0_lr1em3"]
  assert isinstance(run.objective, DisaCentred) and run.anchor == "exact"
  assert run.overrides == {"train.optim.grad_clip": 0.0, "train.optim.lr": 1e-3}
  assert cfg.runs["vargrad_c1_lr1em4"].overrides["train.optim.grad_clip"] == 1.0
  assert cfg.endpoints.step_size == cfg.methods and cfg.endpoints.stable_floor == 0.153
  assert all(cfg.runs[m].seeds == (0,) for m in cfg.methods)


def test_the_onpolicy_block_needs_the_pilots_step_sizes():
  table = main_config.get_config("coupling_pilot").runs
  with pytest.raises(ValueError, match="ONPOLICY_LRS is empty: run the preset coupling_pilot"):
    coupling.onpolicy_grid(table, (0,), {})
  grid = coupling.onpolicy_grid(table, (0, 1), {("disa_exact", "c0"): 3e-4, ("vargrad", "c0"): 1e-3,
                                                ("disa_exact_centred", "c0"): 1e-4,
                                                ("disa", "c0"): 3e-4})
  assert sorted(grid.keys()) == ["disa_c0", "disa_exact_c0", "disa_exact_centred_c0", "vargrad_c0"]
  assert coupling.onpolicy_compare(tuple(grid.keys())) == (
      "disa_exact_c0:vargrad_c0", "disa_exact_centred_c0:vargrad_c0",
      "disa_exact_c0:disa_exact_centred_c0", "disa_c0:vargrad_c0", "disa_c0:disa_exact_c0")
  # the fitted anchor: one seed per replica (the preset runs it on ANCHOR_REPLICAS replicas)
  assert grid["disa_c0"].seeds == (0,) and grid["vargrad_c0"].seeds == (0, 1)
  assert grid["disa_c0"].overrides.train.optim.grad_clip == 0.0 and grid["disa_c0"].lr == 3e-4


def test_the_offpolicy_block_replicates_the_anchor_and_declares_its_equivalence_tests():
  cfg = MainConfig.from_config(main_config.get_config("coupling_offpolicy"))
  reps = cfg.replicated()
  assert set(reps) == {"k0_u4_disa", "k2_u4_disa"} and all(len(r) == 5 for r in reps.values())
  assert cfg.runs["k2_u4_disa"].seeds == (0, 1) and cfg.runs["k2_u4_vargrad"].seeds == tuple(
      range(10))
  spec = cfg.runs["k2_u4_flowrl_paper"]
  assert spec.objective.scale == "mean" and spec.objective.omega == "clipped_ratio"
  assert spec.overrides == {"train.rollout.num_minibatches": 4, "train.rollout.max_staleness": 2,
                            "train.optim.lr": 3e-4}
  assert cfg.stage1.label_scale == "mean"
  assert cfg.endpoints.margins == {"kl_auc": 0.11, "kl_correct_end": 0.05}
  assert len(cfg.endpoints.equivalence_pairs(cfg.methods)) == 4
  assert "kl_end" in cfg.endpoints.endpoints


def test_the_onpolicy_preset_runs_the_pilots_lrs_and_the_anchor_on_replicas():
  cfg = MainConfig.from_config(main_config.get_config("coupling_onpolicy"))
  cells = [m for m in cfg.methods if "_rep" not in m]
  assert len(cells) == 10 and all(cfg.runs[m].overrides["train.optim.lr"] == 1e-3 for m in cells)
  assert set(cfg.replicated()) == {"disa_c0", "disa_c1"}
  assert all(len(r) == 5 for r in cfg.replicated().values())
  assert cfg.runs["vargrad_c0"].seeds == (0, 1, 2, 3, 4) and cfg.runs["disa_c0"].seeds == (0,)
  assert len(cfg.endpoints.pairs(cfg.methods)) == 12 and "kl_end" in cfg.endpoints.endpoints
