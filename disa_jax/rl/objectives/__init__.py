"""Stage 3 objectives as objects: one small frozen class per method, asked and never compared by name.

Each objective carries its own hyperparameters (with the paper's defaults) and declares what a
Stage 3 step must provide for it:

| objective | loss | needs_reference | needs_anchor | has_state | allows_replay |
|---|---|---|---|---|---|
| `Disa` | eq. (10): TB residual with the frozen anchor g_psi(q) | yes | yes | no | yes |
| `DisaCentred` | eq. (10) with the batch's mean residual removed from the frozen log Z (a constant baseline) | yes | yes | no | yes |
| `FlowRL` | eq. (6): TB residual with a co-trained log Z head | yes | no | yes | yes |
| `VarGrad` | eq. (5) with the stop-gradient batch mean of each group as log Z (log-variance loss) | yes | no | no | yes |
| `Grpo` | eqs. (1)-(3): token-clipped surrogate, group z-score advantages | if kl_coef > 0 | no | no | no |
| `Gspo` | sequence-clipped surrogate with the geometric-mean ratio | no | no | no | no |
| `ReplaySft` | NLL of the replayed reward-1 rows (the replay fix's control) | no | no | no | required |

The trainer asks the objective: which passes to run (`needs_reference`, `needs_old_logp`), what
per-row signal the update reads (`row_signal`: the transformed reward r~ for TB objectives, the
group advantage for policy-gradient ones), the loss of a micro-batch (`loss`), and the weight of a
micro-batch when gradients are recombined (`normalizer`). Replay is refused for objectives whose
ratio terms assume on-policy rollouts.

An objective may own trainable state (``has_state``: FlowRL's log Z head): `init_state` builds
its parameters (an `nnx.Module`) and their optimizer (`ObjectiveState`), `state_forward` maps them
and the policy's forward to the extra input of `loss` (``state_out``). The update carries that
state as an opaque slot beside the policy's (`disa_jax.rl.update.TrainState` ``obj_params`` /
``obj_opt_state``) and never looks inside it.

Adding an objective is one class in the module of its family (`trajectory_balance`,
`policy_gradient`, `supervised`; the protocol and registry are `base`): subclass `Objective` (or
`TrajectoryBalance`), declare its needs, implement `row_signal` and `loss` (and, with state,
`init_state` and `state_forward`), and decorate it with `@register`. Configs select it with ``objective.name`` and set its fields by name
(`disa_jax.config.from_mapping`: the objective is a `disa_jax.codec` tagged union); see
`docs/objectives.md`.
"""
from disa_jax.rl.objectives.base import (HEAD_OPTIMIZERS, REGISTRY, Array, Needs, Objective,
                                         ObjectiveState, default_config, names, register)
from disa_jax.rl.objectives.policy_gradient import Grpo, Gspo, PolicyGradient
from disa_jax.rl.objectives.supervised import ReplaySft
from disa_jax.rl.objectives.trajectory_balance import (Disa, DisaCentred, FlowRL,
                                                         TrajectoryBalance, VarGrad)

__all__ = ["Array", "Disa", "DisaCentred", "FlowRL", "Grpo", "Gspo", "HEAD_OPTIMIZERS", "Needs", "Objective",
           "ObjectiveState", "PolicyGradient", "REGISTRY", "ReplaySft", "TrajectoryBalance",
           "VarGrad", "default_config", "names", "register"]
