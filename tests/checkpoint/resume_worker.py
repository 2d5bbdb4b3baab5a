"""A tiny resumable training run used by test_resume.py (run as a subprocess, killed with -9).

Trains a small NNX MLP with AdamW on a deterministic synthetic stream; every step draws fresh
noise from the run's PRNG key and reads the next data-iterator position, so the metrics depend on
params, optimizer state, RNG and data position all being restored. Checkpoints (async) every step.
"""
import argparse
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from disa_jax.checkpoint import CheckpointManager, array_to_rng, rng_to_array  # noqa: E402
from disa_jax.rl.metrics import MetricsLogger  # noqa: E402


class MLP(nnx.Module):

  def __init__(self, rngs):
    self.l1 = nnx.Linear(4, 16, rngs=rngs)
    self.l2 = nnx.Linear(16, 1, rngs=rngs)

  def __call__(self, x):
    return self.l2(jax.nn.tanh(self.l1(x)))[:, 0]


def batch_at(seed, pos):
  rng = np.random.default_rng([seed, pos])
  x = rng.normal(size=(8, 4)).astype(np.float32)
  return x, np.sin(x.sum(-1)).astype(np.float32)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--workdir", required=True)
  ap.add_argument("--steps", type=int, default=30)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--sleep", type=float, default=0.0)
  args = ap.parse_args()

  model = MLP(nnx.Rngs(args.seed))
  graphdef, params = nnx.split(model, nnx.Param)
  params = params.to_pure_dict()
  opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2, weight_decay=0.01))
  state = {"params": params, "opt": opt.init(params),
           "rng": rng_to_array(jax.random.key(args.seed + 1))}
  mngr = CheckpointManager(os.path.join(args.workdir, "ckpt"), max_to_keep=2)
  step, pos = 0, 0
  if mngr.latest_step() is not None:
    step, state, meta = mngr.restore(state)
    pos = meta["data_position"]
    assert meta["step"] == step
  logger = MetricsLogger(args.workdir, resume_step=step if step else None, tensorboard=False)

  @jax.jit
  def train_step(state, x, y):
    key, sub = jax.random.split(array_to_rng(state["rng"]))
    noise = 0.1 * jax.random.normal(sub, x.shape)

    def loss_fn(p):
      m = nnx.merge(graphdef, p)
      return jnp.mean((m(x + noise) - y)**2)

    loss, g = jax.value_and_grad(loss_fn)(state["params"])
    updates, opt_state = opt.update(g, state["opt"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates), "opt": opt_state,
            "rng": rng_to_array(key)}, {"loss": loss, "grad_norm": optax.global_norm(g)}

  while step < args.steps:
    x, y = batch_at(args.seed, pos)
    state, metrics = train_step(state, x, y)
    pos += 1
    step += 1
    logger.write(step, metrics)
    mngr.save(step, state, {"step": step, "data_position": pos})
    if args.sleep:
      time.sleep(args.sleep)
  mngr.close()
  logger.close()


if __name__ == "__main__":
  main()
