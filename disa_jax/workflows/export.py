"""Exports a Stage 3 policy checkpoint as a local HF directory (for evaluation and serving).

The trainer saves orbax checkpoints under ``<run_dir>/checkpoints/<step>`` whose ``state`` item
holds ``params`` (the policy's `nnx.Param` state as a pure dict) beside the optimizer state.
`export_policy` restores only ``params`` (a partial restore: the optimizer moments are never read),
loads them into the backbone named by the run's ``config.json`` (``model.policy_path``), and writes
``config.json``, safetensors shards of at most ``max_shard_bytes`` with their
``model.safetensors.index.json`` (bfloat16 by default; `disa_jax.models.save_pretrained`), plus the
backbone's tokenizer and generation files, so that vLLM, transformers and
`disa_jax.models.from_pretrained` load the trained policy.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from flax import nnx

from disa_jax import codec, models
from disa_jax.checkpoint.selection import Choice, finished_steps

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
SKIP_FILES = ("config.json", "model.safetensors.index.json", "pytorch_model.bin.index.json")
EXPORT_DTYPES = ("bfloat16", "float32")
MAX_SHARD_BYTES = 5 * 2**30  # as transformers' default shard size (5 GB)


def latest_step(run_dir: str | Path) -> int:
  """The newest finished checkpoint step of a Stage 3 run directory."""
  steps = finished_steps(run_dir)
  if not steps:
    raise FileNotFoundError(f"no finished checkpoint under {Path(run_dir) / 'checkpoints'}")
  return steps[-1]


def export_policy(run_dir: str | Path, out_dir: str | Path, *, step: int | None = None,
                  dtype: str = "bfloat16", max_shard_bytes: int = MAX_SHARD_BYTES,
                  overwrite_partial: bool = False, choice: Choice | None = None) -> str:
  """Writes the policy of checkpoint ``step`` (default: the latest) of ``run_dir`` to ``out_dir``.

  Args:
    run_dir: a `launch/train.py` workdir (``config.json`` and ``checkpoints/``).
    out_dir: the HF directory to create (refused when it already holds a config.json).
    step: checkpoint step; None = the latest.
    dtype: storage dtype of the exported weights, one of `EXPORT_DTYPES` (the run's
      ``export_dtype``).
    max_shard_bytes: largest safetensors shard (the index json lists every tensor's shard).
    overwrite_partial: remove an ``out_dir`` left by an interrupted export (one without
      ``export_info.json``, the file written last) instead of refusing it.
    choice: how ``step`` was chosen (`disa_jax.checkpoint.selection.choose_step`), recorded in
      ``export_info.json`` as ``checkpoint``.

  Returns:
    ``out_dir`` as a string.
  """
  if dtype not in EXPORT_DTYPES:
    raise ValueError(f"export dtype must be one of {EXPORT_DTYPES}, got {dtype!r}")
  run_dir, out_dir = Path(run_dir), Path(out_dir)
  if overwrite_partial and out_dir.exists() and not (out_dir / "export_info.json").exists():
    shutil.rmtree(out_dir)
  if (out_dir / "config.json").exists():
    raise FileExistsError(f"{out_dir} already holds a checkpoint; choose a new directory")
  cfg_file = run_dir / "config.json"
  if not cfg_file.exists():
    raise FileNotFoundError(f"{cfg_file} not found: not a launch/train.py workdir")
  model_cfg = json.loads(cfg_file.read_text())["model"]
  policy_path = model_cfg["policy_path"]
  step = latest_step(run_dir) if step is None else int(step)
  state_dir = (run_dir / "checkpoints" / str(step) / "state").resolve()
  if not state_dir.exists():
    raise FileNotFoundError(f"checkpoint step {step} not found: {state_dir}")
  model = models.from_pretrained(policy_path, dtype=jnp.dtype(model_cfg["param_dtype"]))
  params = nnx.state(model, nnx.Param)
  target = {"params": nnx.to_pure_dict(params)}
  # Only this process reads (a multi-process run exports on its main process alone): orbax's
  # barriers span just this process, otherwise they wait for processes that never come.
  this = ocp.options.MultiprocessingOptions(primary_host=jax.process_index(),
                                            active_processes={jax.process_index()})
  with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(multiprocessing_options=this),
                        multiprocessing_options=this) as ckptr:
    restored = ckptr.restore(state_dir, args=ocp.args.PyTreeRestore(
        item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
        partial_restore=True))
  nnx.replace_by_pure_dict(params, restored["params"])
  nnx.update(model, params)
  models.save_pretrained(model, str(out_dir), dtype=jnp.dtype(dtype), max_shard_bytes=max_shard_bytes)
  for f in Path(policy_path).iterdir():  # tokenizer, chat template, generation config
    if f.is_file() and f.name not in SKIP_FILES and not f.name.endswith(WEIGHT_SUFFIXES):
      shutil.copy2(f, out_dir / f.name)
  (out_dir / "export_info.json").write_text(json.dumps(
      {"run_dir": str(run_dir.resolve()), "step": step, "policy_path": policy_path, "dtype": dtype,
       "checkpoint": None if choice is None else codec.encode(choice)}, indent=1))
  return str(out_dir)
