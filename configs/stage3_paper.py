"""Every Stage 3 experiment in the paper, selected by a config string.

  --config=configs/stage3_paper.py:METHOD,BACKBONE,TASK[,beta=B][,proposal=P][,replay=F]

METHOD   disa | flowrl | grpo | gspo                       (Tables 1-2)
BACKBONE qwen2.5-7b | qwen3-4b-base                         (§3.1)
TASK     math (DAPO-17k prompts) | code (DeepCoder prompts)
beta     DISA/FlowRL inverse temperature; the sweep of Fig. 5 is beta=10 / 15 / 20 on
         disa,qwen2.5-7b,code
proposal the Stage 1 proposal behind the DISA anchor: 'qwen3-235b-a22b-instruct-2507' (default) or
         'qwen3-4b-instruct-2507' (the weaker-proposal ablation of Fig. 4, disa,qwen3-4b-base,math)
replay   beyond the paper (disa / flowrl): share F of each group taken from the Stage 1 samples of
         the same proposal (`disa_jax.rl.replay`); off (0) in every paper experiment

Scale: DISA and FlowRL use the length-normalised residual ('mean', 1/|o| on the log-prob terms, as
FlowRL's code does and as the paper's runs did) in Stage 3 and in the Stage 1 labels. The paper's
Props. 1-3 are stated for the trajectory-sum residual ('sum'); set
``--config.train.objective.scale=sum`` here and ``--config.label_scale=sum`` in Stages 1-2 for it.

Model, data and anchor paths are local directories named by `configs/common.py`; override them with
--config.model.policy_path=..., --config.data.train_path=..., --config.data.anchor_path=....
Everything else comes from `configs/stage3_base.py`.
"""
import ml_collections

from configs import common
from configs import stage3_base

METHODS = ("disa", "flowrl", "grpo", "gspo")
TB_METHODS = ("disa", "flowrl")  # the trajectory-balance objectives (beta, proposal, replay)


def _parse(arg: str):
  (method, backbone, task), extra = common.parse(
      arg, first=("METHOD", "BACKBONE", "TASK"), options=("beta", "proposal", "replay"))
  if method not in METHODS:
    raise ValueError(f"config METHOD must be one of {METHODS}, got {method!r}")
  proposal = extra.get("proposal", common.DEFAULT_PROPOSAL)
  common.check(backbone, task, proposal)
  for key in ("beta", "proposal", "replay"):
    if key in extra and method not in TB_METHODS:
      raise ValueError(f"config {key}= only applies to {' and '.join(TB_METHODS)}, got method "
                       f"{method!r}")
  if method == "flowrl" and "proposal" in extra and "replay" not in extra:
    raise ValueError("config proposal= for 'flowrl' names the Stage 1 samples it replays: add replay=F")
  beta = float(extra.get("beta", common.DEFAULT_BETA))
  return method, backbone, task, proposal, beta, float(extra.get("replay", 0.0))


def get_config(arg: str = "disa,qwen2.5-7b,math") -> ml_collections.ConfigDict:
  """The config of one experiment; see the module docstring for ``arg``."""
  method, backbone, task, proposal, beta, replay = _parse(arg)
  c = stage3_base.get_config()
  c.model.policy_path = common.BACKBONES[backbone]
  c.data.train_path, c.data.reward, c.train.validation.n = common.TASKS[task]
  o = c.train.objective = stage3_base.objective(method)
  if method in TB_METHODS:
    o.beta = beta  # paper: 15
    o.scale = "mean"  # FlowRL's code, as the paper's runs (the module docstring; 'sum': eqs. 5-8)
    o.omega = "clipped_ratio"  # FlowRL's code: min(pi_theta / pi_old, 10), detached
  if method == "disa":
    # The anchor Stage 2 fitted on this backbone's pi_ref, task prompts, proposal and beta.
    c.data.anchor_path = common.anchor_dir(backbone, task, proposal, beta)
  if replay:
    c.train.replay.fraction = replay
    c.data.replay_path = common.stage1_dataset(backbone, task, proposal, beta)
  return c
