"""docs/objectives.md: the objectives added "in one class" there (one with trainable state)
register, convert from a config section, and train a step through the real update, with no other
change to the code."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from disa_jax import config as config_lib
from disa_jax import parallel, testing
from disa_jax.rl import losses, objectives
from disa_jax.rl.inputs import EngineLink, StepModels
from disa_jax.rl import update as rl_update
from disa_jax.rl.config import TrainConfig
from tests.rl.helpers import micro_batches, packed_layout, synthetic_sequences

DOC = open("docs/objectives.md").read()
BLOCKS = re.findall(r"```python\n(.*?)```", DOC, re.S)
TINY = dict(num_layers=1, hidden_size=32, intermediate_size=64, num_heads=2, num_kv_heads=2)


def test_the_documented_objective_is_one_class_that_trains():
  code = BLOCKS[0]
  env = dict(vars(objectives.trajectory_balance), jax=jax, jnp=jnp, losses=losses)
  objectives.REGISTRY.pop("disa_huber", None)
  try:
    exec(compile(code, "docs/objectives.md", "exec"), env)  # pylint: disable=exec-used
    cfg = config_lib.from_mapping(TrainConfig, {"objective": {"name": "disa_huber", "delta": 2.0}})
    obj = cfg.objective
    assert type(obj).__name__ == "DisaHuber" and obj.delta == 2.0
    assert obj.needs_anchor and obj.needs_reference and obj.allows_replay  # inherited
    model = testing.make_tiny_model(seed=0, **TINY)
    opt = optax.sgd(0.1)
    graphdef, _, state, _ = rl_update.init_train_state(model, opt)
    step = rl_update.make_train_step(graphdef=graphdef, objective=obj, optimizer=opt,
                                     options=rl_update.StepOptions(donate=False))
    micro = micro_batches(synthetic_sequences(0, 8, 4, 8, vocab=128), packed_layout(4, 12))
    new, metrics = step(state, micro)
    assert np.isfinite(float(metrics["loss"])) and float(metrics["tb_residual_abs_mean"]) > 0
    moved = max(float(jnp.abs(a - b).max()) for a, b in
                zip(jax.tree.leaves(new.params), jax.tree.leaves(state.params)))
    assert moved > 0
    # Huber = the square below delta: with a large delta the loss equals DISA's (omega = 1).
    big = type(obj)(beta=obj.beta, delta=1e6)
    disa = objectives.Disa(beta=obj.beta)
    batch = micro[0]
    logp = -jnp.ones(batch.response_mask.shape) * batch.response_mask
    np.testing.assert_allclose(float(big.loss(logp, batch)[0]), float(disa.loss(logp, batch)[0]),
                               rtol=1e-6)
  finally:
    objectives.REGISTRY.pop("disa_huber", None)


def test_the_documented_objective_with_state_trains_its_parameter():
  code = next(b for b in BLOCKS if "init_state" in b)
  env = dict(vars(objectives.trajectory_balance), jax=jax, jnp=jnp, losses=losses)
  objectives.REGISTRY.pop("disa_offset", None)
  try:
    exec(compile(code, "docs/objectives.md", "exec"), env)  # pylint: disable=exec-used
    cfg = config_lib.from_mapping(TrainConfig, {
        "objective": {"name": "disa_offset", "offset_lr": 0.1},
        "optim": {"lr": 1e-3},
        "rollout": dict(prompts_per_batch=2, group_size=4, max_prompt_len=4, max_response_len=8,
                        num_minibatches=1, micro_batch_rows=4)})
    obj = cfg.objective
    assert type(obj).__name__ == "DisaOffset" and obj.has_state and obj.offset_lr == 0.1
    policy = testing.make_tiny_model(seed=0, **TINY)
    updater = rl_update.PolicyUpdater(cfg, StepModels(policy, None, parallel.make_mesh(
        devices=jax.devices()[:1]), pad_to=4), pad_id=0, link=EngineLink(None))
    before = float(updater.state.obj_params["value"].get_value())
    assert before == 0.0
    seqs = synthetic_sequences(0, 8, 4, 8, vocab=128)
    metrics = updater.update(seqs.scored(updater.pack(0, seqs.rollout)))
    assert np.isfinite(metrics["loss"]) and metrics["objective_grad_norm"] > 0
    after = float(updater.state.obj_params["value"].get_value())
    assert after != before  # the objective's own parameter was trained
    ckpt = updater.checkpoint_state()
    assert set(ckpt) == {"step", "params", "opt_state", "log_z_offset_params",
                         "log_z_offset_opt_state"}
    # The policy's parameters hold no variable of the objective's.
    assert len(jax.tree.leaves(updater.state.params)) == len(
        jax.tree.leaves(nnx.state(testing.make_tiny_model(seed=0, **TINY), nnx.Param)))
  finally:
    objectives.REGISTRY.pop("disa_offset", None)
