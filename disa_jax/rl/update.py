"""Update and sync: the last parts of a Stage 3 step.

`PolicyUpdater` owns the trained state (the policy's parameters, its AdamW state and, for an
objective with state, its parameters and optimizer, `objectives.ObjectiveState`, carried as an
opaque slot) and the jitted update of `disa_jax.rl.train_step`. `update(step, sequences)` runs
``rollout.num_minibatches`` optimizer updates over the step's `TrainSequences`, shuffled with the
step's seed and split into equal mini-batches of sequences, each packed into fixed-shape
micro-batches (`RolloutConfig.layout`); `sync(engine)` pushes the new policy weights (a flat push,
never the objective's state) to the rollout engine.
"""
from __future__ import annotations

from typing import Any

import jax
import numpy as np
from flax import nnx

from disa_jax import models
from disa_jax import parallel
from disa_jax.parallel import distributed
from disa_jax.rl import train_step as ts
from disa_jax.data.packing import sequence_lengths
from disa_jax.rl import seeds
from disa_jax.rl.batch import TrainSequences
from disa_jax.rl.config import OptimConfig, TrainConfig
from disa_jax.rl.inputs import StepModels
from disa_jax.rollout import flat_weights, multihost
from disa_jax.rollout.types import Engine


def _combine(collected: list[dict[str, float]]) -> dict[str, float]:
  """Per-mini-batch metrics -> one dict: max of ``*_max``, min of ``*_min``, mean otherwise.

  ``mismatch/*`` come from the first mini-batch alone: only its forward runs the weights the engine
  was given (the later ones run weights this step has already updated).
  """
  out = {}
  for k in collected[0]:
    vals = [c[k] for c in (collected[:1] if k.startswith("mismatch/") else collected)]
    out[k] = max(vals) if k.endswith("_max") else min(vals) if k.endswith("_min") else float(
        np.mean(vals))
  return out


def optim_kwargs(oc: OptimConfig, updates: int) -> dict[str, Any]:
  """`train_step.make_optimizer` arguments besides the learning rate, from the ``optim`` section
  and the run's ``updates`` (`TrainConfig.total_updates`)."""
  return dict(weight_decay=oc.weight_decay, b1=oc.b1, b2=oc.b2, eps=oc.eps,
              grad_clip=oc.grad_clip, warmup_steps=oc.warmup_steps,
              decay_frac=oc.decay_frac, decay_factor=oc.decay_factor, total_updates=updates)


def optimizer_kwargs(cfg: TrainConfig) -> dict[str, Any]:
  """`disa_jax.optim.make_optimizer` arguments besides the learning rate, from ``cfg.optim`` (the
  policy's AdamW; `PolicyUpdater` zeroes ``grad_clip`` when a joint clip replaces it,
  `objectives.ObjectiveState.clip_with_policy`)."""
  return optim_kwargs(cfg.optim, cfg.total_updates)


class PolicyUpdater:
  """The trained state and its update (see the module docstring).

  Args:
    cfg: the run's config: its objective (loss, state), ``optim``, ``rollout`` (mini-batches,
      micro-batch layout, ``mismatch_threshold``) and ``seed`` (the objective's state and each
      step's shuffle, `disa_jax.rl.seeds`); the learning-rate schedule runs over
      ``cfg.total_updates``, and pi_old comes from the update's own forward when
      ``cfg.old_logp_in_update``.
    step_models: the policy (already sharded on ``step_models.mesh``), the mesh and ``pad_to``
      (without packing, rows are padded to a multiple of it).
    pad_id: padding token id of the packed rows.
  """

  def __init__(self, cfg: TrainConfig, step_models: StepModels, pad_id: int):
    total_updates, old_in_update = cfg.total_updates, cfg.old_logp_in_update
    if total_updates < 1:
      raise ValueError(f"PolicyUpdater total_updates must be >= 1, got {total_updates}")
    policy, mesh = step_models.policy, step_models.mesh
    rollout, seed = cfg.rollout, cfg.seed
    self.rollout, self.seed, self.policy, self.mesh = rollout, seed, policy, mesh
    self.pad_id, self.pad_to = pad_id, step_models.pad_to
    obj, oc = cfg.objective, cfg.optim
    opt_kwargs = optim_kwargs(oc, total_updates)

    def make_opt(lr: float, clip: bool = True):
      return ts.make_optimizer(lr, **{**opt_kwargs, "grad_clip": oc.grad_clip if clip else 0.0})

    # The objective's trainable state (None without): an opaque slot beside the policy's.
    obj_state = obj.init_state(policy.config.hidden_size,
                               lambda name: seeds.objective_seed(seed, name), make_opt, oc.lr)
    joint = obj_state is not None and obj_state.clip_with_policy
    # A joint clip: one clip over policy + objective gradients in the step, none in the optimizers.
    optimizer = make_opt(oc.lr, clip=not joint)
    obj_module, obj_opt, key_seed, self._obj_name = (
        (None, None, 0, None) if obj_state is None else
        (obj_state.module, obj_state.optimizer, obj_state.key_seed, obj_state.name))
    self.graphdef, obj_graphdef, self.state, shardings = ts.init_train_state(
        policy, optimizer, obj_module, obj_opt, mesh=mesh)
    self._step = ts.make_train_step(self.graphdef, obj, optimizer, obj_graphdef=obj_graphdef,
                                    obj_optimizer=obj_opt, mesh=mesh, state_shardings=shardings,
                                    on_policy_old_logp=old_in_update,
                                    joint_clip=oc.grad_clip if joint else 0.0, key_seed=key_seed,
                                    mismatch_threshold=rollout.mismatch_threshold)

  def update(self, step: int, seqs: TrainSequences) -> dict[str, float]:
    """``num_minibatches`` updates over ``seqs``, shuffled with the step's seed.

    Returns:
      The mini-batches' metrics combined, plus ``packing/micro_batches`` (per update) and
      ``packing/efficiency`` (non-padding tokens / computed tokens; a shared prompt counts once
      per unit, `disa_jax.data.packing.PackedBatch.num_real_tokens`).
    """
    rc = self.rollout
    n = len(seqs.prompts)
    layout = rc.layout(sequence_lengths(seqs.prompts, seqs.responses), self.pad_to,
                       parallel.batch_shards(self.mesh))
    order = seeds.minibatch_rng(self.seed, step).permutation(n)
    size = n // rc.num_minibatches
    collected, micro_counts, real, computed = [], [], 0, 0
    for m in range(rc.num_minibatches):
      micro = seqs.micro_batches(order[m * size:(m + 1) * size], layout, pad_id=self.pad_id)
      micro_counts.append(len(micro))
      real += sum(int(mb.rows.segment_ids.astype(bool).sum()) for mb in micro)
      computed += sum(mb.rows.input_ids.size for mb in micro)
      self.state, metrics = self._step(self.state,
                                       [ts.place_micro_batch(mb, self.mesh) for mb in micro])
      collected.append(metrics)
    # One host transfer for all mini-batches' metrics.
    out = _combine([{k: float(v) for k, v in m.items()}
                    for m in distributed.replicate_to_hosts(collected)])
    out.update({"packing/micro_batches": float(np.mean(micro_counts)),
                "packing/efficiency": real / max(computed, 1)})
    return out

  def current_policy(self) -> models.Transformer:
    """The policy `Transformer` holding the trained parameters (updated in place)."""
    nnx.update(self.policy, self.state.params)
    return self.policy

  def sync(self, engine: Engine | None, dtype: Any = None,
           bucket_bytes: int = flat_weights.DEFAULT_BUCKET_BYTES) -> None:
    """Pushes the policy (never the objective's state) to the engine as a flat push
    (`multihost.push_weights`: collective, host copies on host leaders only)."""
    multihost.push_weights(self.current_policy(), engine, dtype=dtype, bucket_bytes=bucket_bytes)

  # -- checkpoints -------------------------------------------------------------------------------

  def checkpoint_state(self) -> dict[str, Any]:
    """The trained state as a checkpoint's tree; the objective's state, if any, under
    ``<name>_params`` / ``<name>_opt_state`` (`objectives.ObjectiveState.name`)."""
    s = self.state
    out = {"step": s.step, "params": nnx.to_pure_dict(s.params), "opt_state": s.opt_state}
    if s.obj_params is not None:
      out[f"{self._obj_name}_params"] = nnx.to_pure_dict(s.obj_params)
      out[f"{self._obj_name}_opt_state"] = s.obj_opt_state
    return out

  def load_checkpoint_state(self, restored: dict[str, Any]) -> None:
    params = self.state.params
    nnx.replace_by_pure_dict(params, restored["params"])
    obj_params, obj_opt_state = self.state.obj_params, None
    if obj_params is not None:
      nnx.replace_by_pure_dict(obj_params, restored[f"{self._obj_name}_params"])
      obj_opt_state = restored[f"{self._obj_name}_opt_state"]
    self.state = ts.TrainState(restored["step"], params, restored["opt_state"], obj_params,
                               obj_opt_state)

  def param_shapes(self) -> dict[str, list[int]]:
    """``{parameter path: shape}`` of the trained state (compared before a resume)."""
    flat = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(self.state.params))[0]
    return {jax.tree_util.keystr(p): list(np.shape(v)) for p, v in flat}
