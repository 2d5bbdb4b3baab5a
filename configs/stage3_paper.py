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

Model, data and anchor paths are local directories named after the experiment; override them with
--config.model.policy_path=..., --config.data.train_path=..., --config.data.anchor_path=....
Everything else comes from `configs/stage3_base.py`.
"""
import importlib.util
import os

import ml_collections

_HERE = os.path.dirname(os.path.abspath(__file__))

BACKBONES = {  # config name -> local HF directory (override with --config.model.policy_path)
    "qwen2.5-7b": "models/Qwen2.5-7B",
    "qwen3-4b-base": "models/Qwen3-4B-Base",
}
TASKS = {  # task -> (training prompts, reward function, eval samples per prompt)
    "math": ("data/dapo-17k-processed.parquet", "math", 8),  # Mean@8
    "code": ("data/deepcoder.parquet", "code", 16),  # pass@1 and pass@16
}
PROPOSALS = ("qwen3-235b-a22b-instruct-2507", "qwen3-4b-instruct-2507")
METHODS = ("disa", "flowrl", "grpo", "gspo")


def _base() -> ml_collections.ConfigDict:
  path = os.path.join(_HERE, "stage3_base.py")
  spec = importlib.util.spec_from_file_location("stage3_base", path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod.get_config()


def _parse(arg: str) -> tuple[str, str, str, dict[str, str]]:
  parts = [p.strip() for p in (arg or "").split(",") if p.strip()]
  if len(parts) < 3:
    raise ValueError(f"config string must be METHOD,BACKBONE,TASK[,key=value...], got {arg!r}")
  method, backbone, task = parts[:3]
  if method not in METHODS:
    raise ValueError(f"config METHOD must be one of {METHODS}, got {method!r}")
  if backbone not in BACKBONES:
    raise ValueError(f"config BACKBONE must be one of {sorted(BACKBONES)}, got {backbone!r}")
  if task not in TASKS:
    raise ValueError(f"config TASK must be one of {sorted(TASKS)}, got {task!r}")
  extra = {}
  for p in parts[3:]:
    key, sep, value = p.partition("=")
    if not sep or key not in ("beta", "proposal", "replay"):
      raise ValueError(f"config option must be beta=..., proposal=... or replay=..., got {p!r}")
    extra[key] = value
  return method, backbone, task, extra


def get_config(arg: str = "disa,qwen2.5-7b,math") -> ml_collections.ConfigDict:
  """The config of one experiment; see the module docstring for ``arg``."""
  method, backbone, task, extra = _parse(arg)
  c = _base()
  c.loss.method = method
  c.model.policy_path = BACKBONES[backbone]
  c.data.train_path, c.data.reward, c.eval.n = TASKS[task]
  c.loss.beta = float(extra.get("beta", c.loss.beta))
  proposal = extra.get("proposal", PROPOSALS[0])
  if proposal not in PROPOSALS:
    raise ValueError(f"config proposal must be one of {PROPOSALS}, got {proposal!r}")
  if method not in ("disa", "flowrl") and "replay" in extra:
    raise ValueError(f"config replay only applies to 'disa' and 'flowrl', got method {method!r}")
  if method not in ("disa", "flowrl") and "proposal" in extra:
    raise ValueError(f"config proposal={proposal!r} only applies to 'disa' and 'flowrl', got {method!r}")
  if method == "flowrl" and "proposal" in extra and "replay" not in extra:
    raise ValueError("config proposal= for 'flowrl' names the Stage 1 samples it replays: add replay=F")
  if method in ("grpo", "gspo") and "beta" in extra:
    raise ValueError(f"config beta only applies to 'disa' and 'flowrl', got method {method!r}")
  if method == "disa":
    # The anchor fitted in Stage 2 on this backbone's pi_ref, task prompts, proposal and beta.
    beta_tag = f"{c.loss.beta:g}"
    c.data.anchor_path = f"anchors/{backbone}_{task}_{proposal}_beta{beta_tag}"
  if "replay" in extra:
    c.replay.fraction = float(extra["replay"])
    # Stage 1's output for this backbone, task and proposal (configs/stage1_paper.py names it).
    c.replay.path = f"stage1/{backbone}_{task}_{proposal}_beta{c.loss.beta:g}"
  if method == "gspo":
    c.loss.eps_low = 3e-4  # GSPO's sequence-ratio clip range (3e-4, 4e-4).
    c.loss.eps_high = 4e-4
  return c
