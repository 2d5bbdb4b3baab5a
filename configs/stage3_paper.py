"""Every Stage 3 experiment in the paper, selected by a config string.

  --config=configs/stage3_paper.py:METHOD,BACKBONE,TASK[,beta=B][,proposal=P][,replay=F][,variant=V][,impl=I]

METHOD   disa | flowrl | grpo | gspo                       (Tables 1-2)
BACKBONE qwen2.5-7b | qwen3-4b-base                         (§3.1)
TASK     math (DAPO-17k prompts) | code (DeepCoder prompts)
beta     DISA/FlowRL inverse temperature; the sweep of Fig. 4 is beta=10 / 15 / 20 on
         disa,qwen2.5-7b,code
proposal the Stage 1 proposal behind the DISA anchor: 'qwen3-235b-a22b-instruct-2507' (default) or
         'qwen3-4b-instruct-2507' (the weaker-proposal ablation of Fig. 3, disa,qwen3-4b-base,math)
replay   beyond the paper (disa / flowrl): share F of each group taken from the Stage 1 samples of
         the same proposal (`disa_jax.rl.replay`); off (0) in every paper experiment
variant  beyond the paper (disa / flowrl): 'pos_replay' adds k = F * G (default F = 0.5) reward-1
         Stage 1 samples of each prompt, deduplicated, to its G on-policy rows (the fix of on-policy
         TB's entropy collapse; docs/real_checkpoints.md says when to use it)
impl     implementation preset (configs/README.md has the table, option by option):
         (absent)     the paper's stated settings; where it is silent, FlowRL's code
         paper        the equations as written: trajectory sums in both stages, omega = 1
         flowrl_verl  everything as FlowRL's veRL fork runs it (veRL core_algos for GRPO / GSPO)
         Stages 1 and 2 take the same impl= (their labels' scale and std must match).

Scale: by default DISA and FlowRL use the length-normalised residual ('mean', 1/|o| on the log-prob
terms, as FlowRL's code does and as the paper's runs did) in Stage 3 and in the Stage 1 labels. The
paper's Props. 1-3 are stated for the trajectory-sum residual ('sum'): ``impl=paper`` uses it in
both stages.

Model, data and anchor paths are local directories named by `configs/common.py`; override them with
--config.model.policy_path=..., --config.data.train_path=..., --config.data.anchor_path=....
Everything else comes from `configs/stage3_base.py`.
"""
import ml_collections

from configs import common
from configs import stage3_base
from disa_jax.rl import objectives

METHODS = ("disa", "flowrl", "grpo", "gspo")
TB_METHODS = ("disa", "flowrl")  # the trajectory-balance objectives (beta, proposal, replay)
VARIANTS = ("", "pos_replay")


def _parse(arg: str):
  (method, backbone, task), extra = common.parse(
      arg, first=("METHOD", "BACKBONE", "TASK"), options=("beta", "proposal", "replay", "variant", "impl"))
  if method not in METHODS:
    raise ValueError(f"config METHOD must be one of {METHODS}, got {method!r}")
  proposal = extra.get("proposal", common.DEFAULT_PROPOSAL)
  common.check(backbone, task, proposal)
  for key in ("beta", "proposal", "replay", "variant"):
    if key in extra and method not in TB_METHODS:
      raise ValueError(f"config {key}= only applies to {' and '.join(TB_METHODS)}, got method "
                       f"{method!r}")
  variant = extra.get("variant", "")
  if variant not in VARIANTS:
    raise ValueError(f"config variant= must be one of {VARIANTS[1:]}, got {variant!r}")
  if ("proposal" in extra and not objectives.REGISTRY[method].needs_anchor
      and not {"replay", "variant"} & set(extra)):
    raise ValueError(f"config proposal= for {method!r} (no anchor) names the Stage 1 samples it "
                     "replays: add replay=F")
  beta = float(extra.get("beta", common.DEFAULT_BETA))
  impl = extra.get("impl", "")
  common.label_facts(impl)  # validates it
  replay = float(extra.get("replay", 0.5 if variant == "pos_replay" else 0.0))
  return method, backbone, task, proposal, beta, replay, variant, impl


OMEGA = {"": "clipped_ratio", "paper": "one", "flowrl_verl": "ratio"}


def _apply_impl(c: ml_collections.ConfigDict, impl: str) -> None:
  """Sets what an implementation preset changes, by the objective's fields (no name checks)."""
  o, facts = c.train.objective, common.label_facts(impl)
  if "scale" in o:  # trajectory balance: the labels' scale and std are the anchor's too
    o.scale = facts["label_scale"]  # '' / flowrl_verl: FlowRL's 1/|o|; paper: sums (eqs. 5-10)
    o.reward_transform.ddof = facts["ddof"]
    o.omega = OMEGA[impl]  # '': veRL's flowrl recipe min(w, 10); paper: 1; FlowRL HEAD: w
  else:
    o.ddof = facts["ddof"]  # advantages: eq. 3's population std, or veRL's sample std
  if impl != "flowrl_verl":
    return
  c.train.optim.weight_decay = 0.1  # flowrl_7B_math.sh
  # 10 warm-up RL steps (FlowRL steps its scheduler once per RL step).
  c.train.optim.warmup_steps = 10 * c.train.rollout.num_minibatches
  if "head_optimizer" in o:
    o.head_optimizer = "joint"  # proj_z in the actor: one AdamW, one gradient clip
  if "loss_agg" in o:
    o.loss_agg, o.dual_clip = "token-mean", 3.0  # veRL actor.yaml defaults


def get_config(arg: str = "disa,qwen2.5-7b,math") -> ml_collections.ConfigDict:
  """The config of one experiment; see the module docstring for ``arg``."""
  method, backbone, task, proposal, beta, replay, variant, impl = _parse(arg)
  run = (backbone, task, proposal, beta, impl)  # the Stage 1 / 2 run behind an anchor or replay
  c = stage3_base.get_config()
  c.model.policy_path = common.BACKBONES[backbone]
  # The longest request is validation's 2048 + 32768 tokens; Qwen3-4B-Base's context is 32768.
  c.engine.vllm_kwargs.max_model_len = common.max_model_len(backbone, 2048 + 32768)
  c.data.train_path, c.data.reward, c.train.validation.n = common.TASKS[task]
  c.data.validation_paths = (common.VALIDATION[task],)  # checkpoint selection (paper App. D)
  o = c.train.objective = stage3_base.objective(method)
  if "beta" in o:
    o.beta = beta  # paper: 15
  _apply_impl(c, impl)
  if objectives.REGISTRY[method].needs_anchor:
    # The anchor Stage 2 fitted on this backbone's pi_ref, task prompts, proposal, beta and labels.
    c.data.anchor_path = common.anchor_dir(*run)
  if replay:
    c.train.replay.fraction = replay
    c.data.replay_path = common.stage1_dataset(*run)
  if variant == "pos_replay":  # issue 15: reward-1 replay added to the on-policy rows
    c.train.replay.update(mode="add", correct_only=True, dedupe=True)
  return c
