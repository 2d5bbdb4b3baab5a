"""Stage 3 policy losses: DISA, FlowRL, VarGrad, GRPO and GSPO as pure jittable functions.

Three modules: `common` (reductions, aggregation, advantages, rollout weights),
`trajectory_balance` (TB, DISA, FlowRL, VarGrad) and `policy_gradient` (GRPO, GSPO, KL, importance
weights, SFT); every name is importable from here.

All four methods share one convention for a batch of B = P * G sampled responses (P prompts, G
responses each, prompt-major so that rows ``p*G : (p+1)*G`` belong to prompt p):

- ``logp``, ``old_logp``, ``ref_logp``: ``[B, T]`` per-token log-probs of the sampled response
  tokens under the current policy pi_theta, the rollout policy pi_old (recorded at rollout time)
  and the frozen reference pi_ref. Values outside ``mask`` are ignored (any finite value).
- ``mask``: ``[B, T]`` 1 on response tokens, 0 on prompt and padding tokens. A row with no response
  token is an invalid (padding) sample: it contributes nothing to the loss or to the metrics.
- per-sequence scalars (transformed rewards r~, advantages): ``[B]``.
- per-prompt scalars (log Z): ``[P]`` with B divisible by P; they are repeated over the G rows of
  each prompt (``G = B // P``; a ``[B]`` array is the special case G = 1).

Aggregation and micro-batching. DISA, FlowRL and GSPO average per-sequence terms over the valid
rows; GRPO averages over rows (``loss_agg='seq-mean-token-mean'``, eq. 2) or over all valid tokens
of the batch (``loss_agg='token-mean'``, veRL's default). A batch split into micro-batches is
recovered exactly by weighting each micro-batch's loss (and gradient) by its normaliser and dividing
by the sum of the normalisers: `loss_normalizer` gives it (valid rows, or valid tokens for
'token-mean').
Every loss returns ``(loss, metrics)`` with scalar float32 metrics.

Defaults are what the paper states; where it is silent they follow FlowRL's veRL fork / veRL, and
the docstring says so. The options that exist to match a reference implementation name its file and
function. References read for this module: veRL ``verl/trainer/ppo/core_algos.py``
(``compute_grpo_outcome_advantage``, ``compute_policy_loss_vanilla``, ``compute_policy_loss_gspo``,
``agg_loss``, ``kl_penalty_forward``) and ``verl/trainer/config/actor/actor.yaml``; FlowRL
(github.com/Xuekai-Zhu/FlowRL, ``verl@FlowRL/verl/workers/actor/dp_actor.py``) and its recipe in
veRL (``recipe/flowrl/flowrl_actor.py``) and in the veRL fork (github.com/Xuekai-Zhu/verl_FlowRL).

Equation numbers are those of the compiled paper (``disa.tex``, numbered equations in order), with
the LaTeX labels: eq. (1) token ratio (``eq:bg:ratio``); eq. (2) clipped surrogate (``eq:bg:ppo``);
eq. (3) group z-score (``eq:bg:grpo-rhat``); eq. (4) the tilted target pi~ and Z(q)
(``eq:m:target``); eq. (5) the TB loss (``eq:bg:tb``); eq. (6) the FlowRL objective with rollout
weights (``eq:bg:flowrl``); eq. (10) the DISA objective (``eq:m:decrl``).
"""
from disa_jax.rl.losses.common import (Array, Metrics, OMEGA_MODES, IS_CORRECTIONS, AGG_KINDS,
                                       KL_KINDS, response_lengths, valid_rows, sequence_sum,
                                       sequence_mean, masked_row_mean, aggregate, loss_normalizer,
                                       expand_prompt_values, group_zscore_advantages,
                                       rollout_weights)
from disa_jax.rl.losses.policy_gradient import (kl_penalty, behaviour_is_weights, mismatch_metrics,
                                                grpo_loss, kl_cov_penalty, sft_loss, gspo_loss)
from disa_jax.rl.losses.trajectory_balance import (tb_residual, tb_loss, disa_loss, flowrl_loss,
                                                   batch_log_z, batch_centred_log_z,
                                                   vargrad_loss)

__all__ = ["AGG_KINDS", "Array", "IS_CORRECTIONS", "KL_KINDS", "Metrics", "OMEGA_MODES",
           "aggregate", "batch_centred_log_z", "batch_log_z", "behaviour_is_weights", "disa_loss",
           "expand_prompt_values", "flowrl_loss", "group_zscore_advantages", "grpo_loss",
           "gspo_loss", "kl_cov_penalty", "kl_penalty", "loss_normalizer", "masked_row_mean",
           "mismatch_metrics", "response_lengths", "rollout_weights", "sequence_mean",
           "sequence_sum", "sft_loss", "tb_loss", "tb_residual", "valid_rows", "vargrad_loss"]
