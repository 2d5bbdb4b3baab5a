"""What a command can check before it loads any weights (`--dry_run`, and every real run first).

`preflight(cfg)` reads only the typed config, `jax.device_count()`, the models' ``config.json`` and
the anchor's saved files, in seconds, and refuses in one error everything that cannot work, naming
each field with a value that would:

- the mesh against the device count (every ``mesh`` field of the command);
- lengths: prompt + response (and the validation length) within the vLLM engine's ``max_model_len``,
  and ``max_model_len`` within the served model's ``max_position_embeddings``;
- the input paths (models need a ``config.json``);
- the anchor of a Stage 3 run against its objective and reference (`workflows.stage3.load_anchor`).

It returns the layout notes a run would otherwise only log (rows per micro-batch on this mesh).
"""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import jax

from disa_jax import parallel
from disa_jax.models import load_config
from disa_jax.parallel.mesh import MeshConfig
from disa_jax.workflows.stage3 import load_anchor


@dataclasses.dataclass(frozen=True)
class Checks:
  """What `preflight` checks for one command's typed config (dotted field names).

  Attributes:
    inputs: paths that must exist ('' = unset, skipped; a tuple or dict field: each entry).
    models: those of ``inputs`` that are HF model directories (need ``config.json``).
    meshes: `MeshConfig` fields.
    rows: (micro_batch_rows field, its mesh field): the rows per micro-batch on that mesh.
    lengths: (prompt field, response field) pairs that must fit the engine's ``max_model_len``.
    served: the model field the engine serves ('' = none).
  """
  inputs: tuple[str, ...] = ()
  models: tuple[str, ...] = ()
  meshes: tuple[str, ...] = ()
  rows: tuple[tuple[str, str], ...] = ()
  lengths: tuple[tuple[str, str], ...] = ()
  served: str = ""


CHECKS: dict[str, Checks] = {
    "Stage1Config": Checks(
        inputs=("prompts_path", "reference_path", "proposal_path"),
        models=("reference_path", "proposal_path"), meshes=("scorer.mesh",),
        lengths=(("max_prompt_len", "sampling.max_tokens"),), served="proposal_path"),
    "Stage2Config": Checks(inputs=("stage1_path", "reference_path"), models=("reference_path",),
                           meshes=("embedding.mesh",)),
    "Stage3Config": Checks(
        inputs=("model.policy_path", "model.reference_path", "data.train_path", "data.anchor_path",
                "data.replay_path", "data.validation_paths", "exact_target.reference_path"),
        models=("model.policy_path", "model.reference_path"), meshes=("mesh",),
        rows=(("train.rollout.micro_batch_rows", "mesh"),),
        lengths=(("train.rollout.max_prompt_len", "train.rollout.max_response_len"),
                 ("train.rollout.max_prompt_len", "train.validation.max_tokens")),
        served="model.policy_path"),
    "EvalConfig": Checks(inputs=("model_path", "run_dir", "benchmarks"), models=("model_path",),
                         lengths=(("max_prompt_len", "max_tokens"),), served="model_path"),
    "SftConfig": Checks(inputs=("reference_path", "stage1_path"), models=("reference_path",),
                        meshes=("mesh",), rows=(("sft.micro_batch_rows", "mesh"),)),
}


class PreflightError(ValueError):
  """Everything a command's config cannot do, one ``field=value: why`` clause per problem."""


def field(cfg: Any, dotted: str) -> Any:
  """The value of a dotted field of a typed config (dataclasses and dicts)."""
  value = cfg
  for part in dotted.split("."):
    value = value[part] if isinstance(value, dict) else getattr(value, part)
  return value


def _mesh_problem(name: str, mesh: MeshConfig, devices: int) -> str | None:
  """Why ``mesh`` cannot be built on ``devices`` devices, with sizes that would work, or None."""
  n = mesh.num_devices or devices
  if mesh.num_devices > devices:
    return f"{name}.num_devices={mesh.num_devices}: only {devices} devices; use 0 (all) or <= {devices}"
  sizes = {"data": mesh.data, "fsdp": mesh.fsdp, "tensor": mesh.tensor}
  fixed = math.prod(s for s in sizes.values() if s != -1)
  free = [k for k, s in sizes.items() if s == -1]
  if (free and n % fixed == 0) or (not free and fixed == n):
    return None
  given = ", ".join(f"{name}.{k}={s}" for k, s in sizes.items())
  return (f"{given} need {'a multiple of ' if free else ''}{fixed} devices, {n} present; a value "
          f"that works: {name}.data=1, {name}.fsdp=-1, {name}.tensor=1 (fsdp over all {n})")


def _paths(cfg: Any, checks: Checks) -> list[str]:
  problems = []
  for name in checks.inputs:
    value = field(cfg, name)
    entries = (value.items() if isinstance(value, dict) else
               ((f"{name}[{i}]", v) for i, v in enumerate(value)) if isinstance(value, tuple) else
               ((name, value),))
    for label, path in entries:
      label = f"{name}.{label}" if isinstance(value, dict) else label
      if path and not Path(path).exists():
        problems.append(f"{label}={path!r}: no such file or directory (a local path; "
                        "Hugging Face hub names are not downloaded)")
      elif path and name in checks.models and not (Path(path) / "config.json").is_file():
        problems.append(f"{label}={path!r}: not a Hugging Face model directory (no config.json)")
  return problems


def _lengths(cfg: Any, checks: Checks) -> list[str]:
  engine = getattr(cfg, "engine", None)
  if engine is None or engine.kind != "vllm" or "max_model_len" not in engine.vllm_kwargs:
    return []
  limit, problems = int(engine.vllm_kwargs["max_model_len"]), []
  for prompt, response in checks.lengths:
    need = int(field(cfg, prompt)) + int(field(cfg, response))
    if need > limit:
      problems.append(f"{prompt} + {response} = {need} > engine.vllm_kwargs.max_model_len={limit}; "
                      f"set engine.vllm_kwargs.max_model_len={need} or shorten {response}")
  served = field(cfg, checks.served) if checks.served else ""
  if served and (Path(served) / "config.json").is_file():
    most = load_config(served).max_position_embeddings
    if limit > most:
      problems.append(f"engine.vllm_kwargs.max_model_len={limit} > max_position_embeddings={most} "
                      f"of {checks.served}={served!r}; use max_model_len <= {most} (and responses that "
                      "fit), or engine.process.env.VLLM_ALLOW_LONG_MAX_MODEL_LEN='1' to exceed "
                      "the trained context")
  return problems


def _anchor(cfg: Any) -> list[str]:
  """A Stage 3 run's anchor against its objective (the anchor's files only; no LLM weights)."""
  if type(cfg).__name__ != "Stage3Config" or not cfg.data.anchor_path:
    return []
  reference = cfg.model.reference
  if not (Path(cfg.data.anchor_path).exists() and (Path(reference) / "config.json").is_file()):
    return []  # already reported by _paths
  try:
    load_anchor(cfg, load_config(reference).hidden_size)
  except (ValueError, FileNotFoundError) as e:
    return [str(e)]
  return []


def preflight(cfg: Any) -> list[str]:
  """Checks ``cfg`` (a command's typed config) before any weights load.

  Returns:
    Notes on the layout the run will use (rows per micro-batch on its mesh).

  Raises:
    PreflightError: every problem found, each naming its field(s) and a value that would work.
  """
  checks = CHECKS.get(type(cfg).__name__)
  if checks is None:
    raise TypeError(f"preflight: no checks declared for {type(cfg).__name__}")
  devices = jax.device_count()
  problems = [p for name in checks.meshes
              if (p := _mesh_problem(name, field(cfg, name), devices)) is not None]
  problems += _lengths(cfg, checks) + _paths(cfg, checks)
  if not problems:
    problems += _anchor(cfg)
  if problems:
    raise PreflightError(" | ".join(problems))
  notes = []
  for rows_field, mesh_field in checks.rows:
    mesh = field(cfg, mesh_field).make()
    rows, shards = field(cfg, rows_field), parallel.batch_shards(mesh)
    notes.append(f"{rows_field}={rows} -> {parallel.rows_for_mesh(rows, shards)} rows per "
                 f"micro-batch on mesh {dict(mesh.shape)} (data x fsdp = {shards})")
  return notes
