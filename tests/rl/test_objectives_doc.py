"""docs/objectives.md: the objective added "in one class" there registers, converts from a config
section, and trains a step through the real update, with no other change to the code."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax

from disa_jax import config as config_lib
from disa_jax import testing
from disa_jax.rl import losses, objectives
from disa_jax.rl import train_step as ts
from disa_jax.rl.config import TrainConfig
from tests.rl.helpers import micro_batches, packed_layout, synthetic_sequences

DOC = open("docs/objectives.md").read()


def test_the_documented_objective_is_one_class_that_trains():
  code = re.search(r"```python\n(.*?)```", DOC, re.S).group(1)
  env = dict(vars(objectives), jax=jax, jnp=jnp, losses=losses)
  objectives.REGISTRY.pop("disa_huber", None)
  try:
    exec(compile(code, "docs/objectives.md", "exec"), env)  # pylint: disable=exec-used
    cfg = config_lib.from_mapping(TrainConfig, {"objective": {"name": "disa_huber", "delta": 2.0}})
    obj = cfg.objective
    assert type(obj).__name__ == "DisaHuber" and obj.delta == 2.0
    assert obj.needs_anchor and obj.needs_reference and obj.allows_replay  # inherited
    model = testing.make_tiny_model(seed=0, num_layers=1, hidden_size=32, intermediate_size=64,
                                    num_heads=2, num_kv_heads=2)
    opt = optax.sgd(0.1)
    graphdef, _, state, _ = ts.init_train_state(model, opt)
    step = ts.make_train_step(graphdef, obj, opt, donate=False)
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
