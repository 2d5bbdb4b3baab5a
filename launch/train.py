r"""Stage 3 entry point: DISA / FlowRL / GRPO / GSPO training.

  python launch/train.py --config=configs/stage3_paper.py:disa,qwen2.5-7b,math \
      --config.model.policy_path=/models/Qwen2.5-7B --config.data.anchor_path=/anchors/q25-math \
      --workdir=/runs/disa-q25-math

The ConfigDict (with ``--config.field=value`` overrides) is converted once into the typed
`disa_jax.rl.config.TrainConfig`, which validates every field. Re-running with the same
``--workdir`` resumes from its latest checkpoint. The resolved config is written to
``<workdir>/config.json``.
"""
from __future__ import annotations

import json
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
  sys.path.insert(0, _ROOT)

from absl import app  # noqa: E402
from absl import flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from disa_jax.rl.config import TrainConfig  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None,
                                          "Stage 3 config file (configs/stage3_paper.py:...).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (metrics, checkpoints).")
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "Validate and print the config, then exit.")


def config_from_flags(config_dict) -> TrainConfig:
  """ConfigDict -> validated TrainConfig (unknown fields and bad values raise ValueError)."""
  return TrainConfig.from_dict(config_dict.to_dict())


def build_and_run(cfg: TrainConfig, workdir: str) -> None:
  """Loads models, data, reward, anchor and engine, then runs the `Trainer`."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from transformers import AutoTokenizer  # pylint: disable=g-import-not-at-top

  from disa_jax import models, parallel, rewards, rollout  # pylint: disable=g-import-not-at-top
  from disa_jax.data import loaders, templates  # pylint: disable=g-import-not-at-top
  from disa_jax.parallel import distributed  # pylint: disable=g-import-not-at-top
  from disa_jax.rl.trainer import PromptItem, Trainer  # pylint: disable=g-import-not-at-top

  mc = cfg.model
  if not mc.policy_path:
    raise ValueError("model.policy_path is required (a local HF directory), got ''")
  if not cfg.data.train_path:
    raise ValueError("data.train_path is required, got ''")
  tokenizer = AutoTokenizer.from_pretrained(mc.policy_path)
  mesh = parallel.make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor)
  # from_pretrained ties storage and compute dtype: the policy is loaded in param_dtype (the AdamW
  # master copy) and then computes in dtype; the frozen reference is stored in dtype.
  policy = models.from_pretrained(mc.policy_path, dtype=jnp.dtype(mc.param_dtype), mesh=mesh,
                                  remat=mc.remat, scan_unroll=mc.scan_unroll)
  policy.dtype = jnp.dtype(mc.dtype)
  reference = models.from_pretrained(mc.reference_path or mc.policy_path,
                                     dtype=jnp.dtype(mc.dtype), mesh=mesh)

  def items_from(path: str) -> list[PromptItem]:
    out = []
    for rec in loaders.load_prompts(path):
      text = templates.render_chat(tokenizer, rec.prompt)
      ids = tuple(tokenizer.encode(text, add_special_tokens=False))
      out.append(PromptItem(rec.prompt_id, ids, rec.reward_meta()))
    return out

  score = rewards.get_reward_fn(cfg.data.reward)

  def reward_fn(items, responses):
    texts = tokenizer.batch_decode([np.asarray(r).tolist() for r in responses],
                                   skip_special_tokens=True)
    return score(texts, [dict(it.meta) for it in items])

  anchor = None
  if cfg.loss.method == "disa":
    from disa_jax.anchor import Anchor  # pylint: disable=g-import-not-at-top
    anchor = Anchor.load(cfg.data.anchor_path)
  eval_items = [it for p in cfg.eval.paths for it in items_from(p)]
  # One generation process per host, owned by the host's first process (all of them in a
  # single-process run); DISA_GENERATION_GPUS gives it the GPUs the trainer leaves free.
  engine = None
  if distributed.is_host_leader():
    child_env = {"env": distributed.generation_env()} if cfg.rollout.separate_process else {}
    engine = rollout.make_engine(cfg.rollout.engine, mc.policy_path,
                                 separate_process=cfg.rollout.separate_process, **child_env)
  try:
    trainer = Trainer(cfg, workdir, policy=policy, reference=reference, engine=engine,
                      prompts=items_from(cfg.data.train_path), reward_fn=reward_fn,
                      stop_token_ids=(tokenizer.eos_token_id,), pad_id=tokenizer.pad_token_id,
                      anchor=anchor, eval_prompts=eval_items, mesh=mesh)
    trainer.run()
    trainer.close()
  finally:
    if engine is not None:
      engine.close()


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  cfg = config_from_flags(_CONFIG.value)
  from disa_jax.parallel import distributed  # pylint: disable=g-import-not-at-top
  distributed.initialize()  # no-op without a multi-process launcher's variables
  if _DRY_RUN.value:
    print(json.dumps(cfg.to_dict(), indent=1))
    return
  if not _WORKDIR.value:
    raise app.UsageError("--workdir is required")
  os.makedirs(_WORKDIR.value, exist_ok=True)
  if distributed.is_main_process():
    with open(os.path.join(_WORKDIR.value, "config.json"), "w") as f:
      json.dump(cfg.to_dict(), f, indent=1)
  build_and_run(cfg, _WORKDIR.value)


if __name__ == "__main__":
  flags.mark_flag_as_required("config")
  app.run(main)
