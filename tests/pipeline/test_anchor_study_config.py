"""Issue 27's options of the main job, checked without running it: the regime-grid presets build a
valid Stage 3 config for every cell, the noisy-anchor and per-run update options are validated, and
the held-out split of the n values is disjoint and reproducible."""
import pytest

from configs import main as main_config
from disa_jax.pipeline.heldout import HeldoutConfig, split_values
from disa_jax.pipeline.job_config import MainConfig, RunSpec
from disa_jax.pipeline.sum_job import SumJob
from disa_jax.rl.objectives import Disa, FlowRL, VarGrad
from disa_jax.tasks.prompts import load_prompts


def _job(c, tmp_path):
  return SumJob(MainConfig.from_config(c), tmp_path, progress=False)


def test_regime_grid_cells(tmp_path):
  job = _job(main_config.get_config("anchor_study_rl"), tmp_path)
  cfgs = {m: job.stage3_cfgs[(m, 0)] for m in job.cfg.methods}
  assert len(cfgs) == 16
  for name, cfg in cfgs.items():
    scale, updates, source = name.split("_")
    obj = cfg.train.objective
    assert obj.scale == scale == "sum" and obj.reward_transform.kind == "raw"
    assert cfg.train.rollout.num_minibatches == int(updates[1:])
    kind = {"fitted": Disa, "exact": Disa, "flowrl": FlowRL, "vargrad": VarGrad}.get(source, Disa)
    assert type(obj) is kind, name
    want_anchor = {"fitted": job.stage2_cfg.anchor_path, "exact": job.exact_anchor_path, "flowrl": "",
                   "vargrad": ""}.get(source)
    if source.startswith("noise"):
      sigma = float(source[len("noise"):].replace("p", "."))
      assert sigma in main_config.NOISE_SIGMAS and job.cfg.runs[name].sigma == sigma
      want_anchor = job.noise_anchor_path(sigma)
    assert cfg.data.anchor_path == want_anchor, name
  assert {n.split("_")[2] for n in cfgs} == {"exact", "fitted", "flowrl", "vargrad", "noise0p25",
                                             "noise0p5", "noise1", "noise2"}
  mean = _job(main_config.get_config("anchor_study_rl_mean"), tmp_path / "mean")
  assert mean.stage1_cfg.label_scale == "mean" and len(mean.cfg.methods) == 6
  assert all(mean.stage3_cfgs[(m, 0)].train.objective.scale == "mean" for m in mean.cfg.methods)


def test_nonuniform_target_preset(tmp_path):
  c = main_config.get_config("nonuniform_target")
  job = _job(c, tmp_path)
  ref, prop = job.cfg.reference_model, job.cfg.proposal_model
  assert ref.skew > 1 > prop.skew  # pi_ref prefers large first summands, p_T small ones
  assert job.cfg.conditional_kl


def test_run_spec_and_scale_errors_name_the_field(tmp_path):
  with pytest.raises(ValueError, match="sigma must be > 0 with anchor='exact\\+noise'.*sigma=0"):
    RunSpec(objective=Disa(), anchor="exact+noise")
  with pytest.raises(ValueError, match="sigma=0.5 with anchor='exact'"):
    RunSpec(objective=Disa(), anchor="exact", sigma=0.5)
  with pytest.raises(ValueError, match=r"runs.x.minibatches must be an int >= 0 .*got -1"):
    RunSpec.from_config({"objective": Disa(), "minibatches": -1}, "runs.x")
  with pytest.raises(ValueError, match="anchor='exact\\+noise' is set but objective 'vargrad'"):
    RunSpec(objective=VarGrad(), anchor="exact+noise", sigma=1.0)
  c = main_config.get_config("anchor_study_rl")
  c.stage1.label_scale = "mean"
  with pytest.raises(ValueError, match="runs.sum_u1_exact.anchor='exact' needs "
                                       "stage1.label_scale='sum'.*'mean'"):
    _job(c, tmp_path)


def test_heldout_split_disjoint_and_reproducible():
  ns = list(range(41))
  train, held = split_values(ns, 0.2, seed=0)
  assert len(held) == 8 and len(train) == 33
  assert not set(train) & set(held) and sorted(train + held) == ns
  assert split_values(ns, 0.2, seed=0) == (train, held)
  assert split_values(ns, 0.2, seed=1)[1] != held
  assert split_values([3, 7], 0.01, seed=0)[1] in ((3,), (7,))  # at least one held out
  with pytest.raises(ValueError, match="fraction must be in \\(0, 1\\), got 1.0"):
    split_values(ns, 1.0, seed=0)
  with pytest.raises(ValueError, match="heldout.fraction must be in \\[0, 1\\), got -0.1"):
    HeldoutConfig(fraction=-0.1)


def test_heldout_option_splits_the_stage3_prompts(tmp_path):
  c = main_config.get_config()
  c.task.n_max = 40  # 41 prompts: 8 held out
  c.heldout.fraction = 0.2
  job = _job(c, tmp_path)
  cfg = job.stage3_cfgs[("disa", 0)]
  assert cfg.data.train_path == job.train_prompts_path != job.prompts_path
  assert job.eval_template.benchmarks == {"task": job.prompts_path,
                                          "heldout": job.heldout_prompts_path}
  job.write_prompts()
  files = {k: [r.prompt_id for r in load_prompts(p)] for k, p in (
      ("all", job.prompts_path), ("train", job.train_prompts_path),
      ("heldout", job.heldout_prompts_path))}
  assert len(files["heldout"]) == 8 and not set(files["train"]) & set(files["heldout"])
  assert sorted(files["train"] + files["heldout"]) == sorted(files["all"])
  plain = _job(main_config.get_config(), tmp_path / "plain")
  assert plain.stage3_cfgs[("disa", 0)].data.train_path == plain.prompts_path
  assert plain.eval_template.benchmarks == {"task": plain.prompts_path}


def test_staleness_study_preset_sets_each_runs_staleness(tmp_path):
  job = _job(main_config.get_config("staleness_study"), tmp_path)
  assert job.cfg.seeds == (0, 1, 2, 3, 4) and len(job.cfg.methods) == 14 + 3 * 4
  # the fitted anchor's 3 cells on 5 anchor replicas x 1 seed: 70 runs, as at 5 seeds of one anchor
  assert sum(len(job.cfg.run_seeds(m)) for m in job.cfg.methods) == 70
  assert job.cfg.run_seeds("k2_disa_halflr_rep4") == (0,) and len(job.replicas) == 5
  for name in job.cfg.methods:
    k, method = name.split("_", 1)
    method = method.split("_rep")[0]
    cfg = job.stage3_cfgs[(name, 0)]
    assert cfg.train.rollout.max_staleness == int(k[1:]) in main_config.STALENESS, name
    half = method.endswith("_halflr")  # the TB delay control: the same run at half the lr
    method = method.removesuffix("_halflr")
    want_lr = main_config.HALF_LR if half else main_config.STALENESS_LR
    assert cfg.train.optim.lr == want_lr, name
    obj = cfg.train.objective
    assert obj.name == {"disa_exact": "disa", "grpo_tis": "grpo"}.get(method, method)
    if method == "grpo_tis":
      assert obj.is_correction == "tis" and obj.is_cap == 2.0
    elif method == "grpo":
      assert obj.is_correction == "none"
  assert {n for n in job.cfg.methods if n.endswith("_halflr")} == {
      "k2_disa_halflr", "k2_disa_exact_halflr", "k2_flowrl_halflr"}
  with pytest.raises(ValueError, match="staleness must be an int >= 0 .* got -1"):
    RunSpec.from_config({"objective": Disa(), "staleness": -1})
  with pytest.raises(ValueError, match=r"lr must be a number >= 0 .* got -0.1"):
    RunSpec.from_config({"objective": Disa(), "lr": -0.1})
