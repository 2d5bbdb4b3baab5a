"""What a command can check before it loads any weights (`--dry_run`, and every real run first).

`preflight(cfg)` reads only the typed config, `jax.device_count()`, the models' ``config.json``
(and ``generation_config.json``) and the anchor's saved files, in seconds, and refuses in one error
everything that cannot work, naming each field with a value that would:

- the mesh against the device count (every ``mesh`` field of the command);
- the input paths, local or URLs (``gs://``: checked on their file system, `disa_jax.paths`;
  models are local directories and need a ``config.json``); a model the JAX model reader loads (the
  policy, pi_ref) must be one it implements (dense Qwen2/2.5, Qwen3, Llama-3; a mixture-of-experts
  proposal runs in vLLM only and is read for its lengths alone);
- lengths, against the model that generates them (`served_context`: its ``config.json`` read as
  vLLM reads it): the vLLM engine's ``max_model_len`` (None: that context) within the served
  model's context unless ``VLLM_ALLOW_LONG_MAX_MODEL_LEN=1``, and every prompt + response within
  ``max_model_len`` where the context allows it. vLLM ends a response at ``max_model_len``
  (finish reason 'length'), so a response limit beyond the context is a note, not an error: the
  paper's 32,768-token evaluation responses on Qwen3-4B-Base's 32,768-token context stop at the
  context minus the prompt;
- the anchor of a Stage 3 run against its objective and reference (`workflows.stage3.load_anchor`).

`check_outputs(cfg)` checks the command's output paths: each set and writable (a probe file in
the nearest existing directory: a read-only disk, a missing permission or a path under a file is
one error naming the field), and with ``claims=True`` (the launchers' ``--dry_run``) the stage's
own identity check (`disa_jax.checkpoint.identity`, through the stage's claim function) against
what a rerun would resume, writing nothing: another run's outputs stop it, naming every differing
field and ``overwrite``.

`preflight` returns the notes a run would otherwise only log (rows per micro-batch on this mesh,
responses the context cuts).
"""
from __future__ import annotations

import dataclasses
import importlib
import json
import math
import os
import tempfile
import uuid
from pathlib import Path
from typing import Any, Callable

import jax

from disa_jax import parallel, paths
from disa_jax.checkpoint import identity
from disa_jax.models import load_config
from disa_jax.parallel.mesh import MeshConfig
from disa_jax.workflows.stage3 import load_anchor


@dataclasses.dataclass(frozen=True)
class Checks:
  """What `preflight` / `check_outputs` check for one command's typed config (dotted fields).

  Attributes:
    inputs: paths that must exist ('' = unset, skipped; a tuple or dict field: each entry).
    models: those of ``inputs`` that are HF model directories (need ``config.json``).
    jax_models: those of ``models`` the JAX model reader loads (its supported families only).
    meshes: `MeshConfig` fields.
    rows: (micro_batch_rows field, its mesh field): the rows per micro-batch on that mesh.
    lengths: (prompt field, response field) pairs that must fit the engine's ``max_model_len``.
    served: the model field the engine serves ('' = none).
    outputs: the paths the command writes (required, writable).
    claim: ``'module:function'``, the stage's identity claim (cfg -> state), '' = none.
  """
  inputs: tuple[str, ...] = ()
  models: tuple[str, ...] = ()
  jax_models: tuple[str, ...] = ()
  meshes: tuple[str, ...] = ()
  rows: tuple[tuple[str, str], ...] = ()
  lengths: tuple[tuple[str, str], ...] = ()
  served: str = ""
  outputs: tuple[str, ...] = ()
  claim: str = ""


CHECKS: dict[str, Checks] = {
    "Stage1Config": Checks(
        inputs=("prompts_path", "reference_path", "proposal_path"),
        models=("reference_path", "proposal_path"), jax_models=("reference_path",),
        meshes=("scorer.mesh",), lengths=(("max_prompt_len", "sampling.max_tokens"),),
        served="proposal_path", outputs=("output_dir",),
        claim="disa_jax.workflows.stage1:claim_stage1_output"),
    "Stage2Config": Checks(
        inputs=("stage1_path", "reference_path"), models=("reference_path",),
        jax_models=("reference_path",), meshes=("embedding.mesh",),
        outputs=("output_dir", "anchor_path"),
        claim="disa_jax.workflows.stage2:claim_stage2_output"),
    "Stage3Config": Checks(
        inputs=("model.policy_path", "model.reference_path", "data.train_path", "data.anchor_path",
                "data.replay_path", "data.validation_paths", "exact_target.reference_path"),
        models=("model.policy_path", "model.reference_path"),
        jax_models=("model.policy_path", "model.reference_path"), meshes=("mesh",),
        rows=(("train.rollout.micro_batch_rows", "mesh"),),
        lengths=(("train.rollout.max_prompt_len", "train.rollout.max_response_len"),
                 ("train.rollout.max_prompt_len", "train.validation.max_tokens")),
        served="model.policy_path", outputs=("workdir",),
        claim="disa_jax.workflows.stage3:claim_stage3_output"),
    "EvalConfig": Checks(
        inputs=("model_path", "run_dir", "benchmarks"), models=("model_path",),
        lengths=(("max_prompt_len", "max_tokens"),), served="model_path", outputs=("output_dir",),
        claim="disa_jax.workflows.preflight:claim_evaluation_outputs"),
    "SftConfig": Checks(
        inputs=("reference_path", "stage1_path"), models=("reference_path",),
        jax_models=("reference_path",), meshes=("mesh",), rows=(("sft.micro_batch_rows", "mesh"),),
        outputs=("out_path",), claim="disa_jax.workflows.sft:claim_sft_output"),
    # Its inputs: `workflows.nstudy.preflight_nstudy` (the pool's Stage 1 config).
    "NStudyConfig": Checks(outputs=("output_dir",),
                           claim="disa_jax.workflows.nstudy:claim_nstudy_output"),
}
# The keys vLLM derives a model's context from (the smallest one present), and the RoPE types whose
# ``factor`` it does not apply again (their max_position_embeddings is already the scaled length).
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length",
                "model_max_length", "max_sequence_length", "max_seq_length", "seq_len")
SCALED_ROPE_TYPES = ("default", "su", "longrope", "llama3", "yarn", "deepseek_yarn",
                     "deepseek_llama_scaling")
ALLOW_LONG = "VLLM_ALLOW_LONG_MAX_MODEL_LEN"


class PreflightError(ValueError):
  """Everything a command's config cannot do, one ``field=value: why`` clause per problem."""


def field(cfg: Any, dotted: str) -> Any:
  """The value of a dotted field of a typed config (dataclasses and dicts)."""
  value = cfg
  for part in dotted.split("."):
    value = value[part] if isinstance(value, dict) else getattr(value, part)
  return value


def _read_json(path: Path) -> dict[str, Any]:
  """A JSON object file; an unreadable one is an error naming it."""
  try:
    obj = json.loads(path.read_text())
  except (OSError, ValueError) as e:
    raise PreflightError(f"{path}: unreadable ({e})") from None
  if not isinstance(obj, dict):
    raise PreflightError(f"{path}: holds a {type(obj).__name__}, not a JSON object")
  return obj


def served_context(path: str) -> int:
  """The context length (tokens) vLLM derives from a model directory's ``config.json``: the
  smallest of `CONTEXT_KEYS` present (a multimodal config's ``text_config``), times the RoPE
  ``factor`` of a scaling type that does not already include it. Reads nothing else; any model
  type (a mixture-of-experts proposal too). ``generation_config.json``, where present, must be a
  JSON object (the stop ids come from its ``eos_token_id``).

  Raises:
    PreflightError: an unreadable file, or a config without any context key (both named).
  """
  hf = _read_json(Path(path) / "config.json")
  hf = hf.get("text_config") or hf
  lengths = [int(hf[k]) for k in CONTEXT_KEYS if isinstance(hf.get(k), (int, float))]
  if not lengths:
    raise PreflightError(f"{path}/config.json: no context length ({', '.join(CONTEXT_KEYS)})")
  rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
  kind = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
  factor = rope.get("factor") if kind not in SCALED_ROPE_TYPES else None
  if (Path(path) / "generation_config.json").exists():
    _read_json(Path(path) / "generation_config.json")
  return int(min(lengths) * (factor or 1.0))


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
      if path and name in checks.models and paths.is_remote(path):
        problems.append(f"{label}={path!r}: a model must be a local directory (the model readers "
                        "and vLLM read local files); copy it to local disk")
      elif path and not paths.as_path(path).exists():
        problems.append(f"{label}={path!r}: no such file or directory (a local path or a URL "
                        "such as gs://...; Hugging Face hub names are not downloaded)")
      elif path and name in checks.models and not (Path(path) / "config.json").is_file():
        problems.append(f"{label}={path!r}: not a Hugging Face model directory (no config.json)")
      elif path and name in checks.jax_models:
        try:
          load_config(path)
        except (ValueError, KeyError, TypeError) as e:
          problems.append(f"{label}={path!r}: {e} (the JAX model reader loads this model: dense "
                          "Qwen2/2.5, Qwen3, Llama-3; mixture-of-experts models run in vLLM only)")
  return problems


def _allows_long(engine: Any) -> bool:
  """Whether the generation process runs with VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 (its own env section
  or, inherited, this process's)."""
  value = engine.process.env.get(ALLOW_LONG, os.environ.get(ALLOW_LONG, "0"))
  return str(value).strip().lower() in ("1", "true")


def _served(cfg: Any, checks: Checks) -> tuple[str, str]:
  """(how to name it, path) of the model the engine serves: the ``served`` field, or the policy of
  an evaluated Stage 3 ``run_dir`` (its config.json; the exported checkpoint keeps that model's
  config.json), or '' where neither is known."""
  path = field(cfg, checks.served) if checks.served else ""
  where = f"{checks.served}={path!r}"
  run_config = Path(getattr(cfg, "run_dir", "") or "") / "config.json"
  if not path and run_config.is_file():
    path = _read_json(run_config).get("model", {}).get("policy_path", "")
    where = f"the policy of run_dir={cfg.run_dir!r}, {path!r}"
  return where, path if path and (Path(path) / "config.json").is_file() else ""


def _lengths(cfg: Any, checks: Checks) -> tuple[list[str], list[str]]:
  """(problems, notes) of the prompt + response lengths against the served model's context."""
  engine = getattr(cfg, "engine", None)
  if engine is None or engine.kind != "vllm" or not checks.lengths:
    return [], []
  where, served = _served(cfg, checks)
  context = served_context(served) if served else None
  configured = engine.vllm_kwargs.get("max_model_len")
  limit = int(configured) if configured is not None else context
  if limit is None:
    return [], []  # no model to read yet: reported by _paths, or a run_dir still to train
  long_ok = _allows_long(engine)
  problems, notes = [], []
  if context is not None and limit > context and not long_ok:
    problems.append(f"engine.vllm_kwargs.max_model_len={limit} > the context of {where}, "
                    f"{context} tokens (its config.json); use max_model_len <= {context} or None "
                    f"(= the context), or engine.process.env.{ALLOW_LONG}='1' to exceed it")
  ceiling = context if context is not None and not long_ok else math.inf
  for prompt, response in checks.lengths:
    p, r = int(field(cfg, prompt)), int(field(cfg, response))
    needed = min(p + r, ceiling)
    if p >= min(limit, ceiling):
      problems.append(f"{prompt}={p} leaves no room for a response in max_model_len="
                      f"{min(limit, ceiling)} (the context of {where})")
    elif limit < needed:
      problems.append(f"{prompt} + {response} = {p + r} > engine.vllm_kwargs.max_model_len="
                      f"{limit}; set engine.vllm_kwargs.max_model_len={int(needed)} or shorten "
                      f"{response}")
    elif p + r > limit:
      notes.append(f"{prompt} + {response} = {p + r} > max_model_len={limit}, the context of "
                   f"{where}: vLLM ends a response there (finish reason 'length'), after at least "
                   f"{limit - p} tokens")
  return problems, notes


def _anchor(cfg: Any) -> list[str]:
  """A Stage 3 run's anchor against its objective (the anchor's files only; no LLM weights)."""
  if type(cfg).__name__ != "Stage3Config" or not cfg.data.anchor_path:
    return []
  reference = cfg.model.reference
  if not (paths.as_path(cfg.data.anchor_path).exists()
          and (Path(reference) / "config.json").is_file()):
    return []  # already reported by _paths
  try:
    load_anchor(cfg, load_config(reference).hidden_size)
  except (ValueError, FileNotFoundError) as e:
    return [str(e)]
  return []


def preflight(cfg: Any) -> list[str]:
  """Checks ``cfg`` (a command's typed config) before any weights load.

  Returns:
    Notes on the layout the run will use (rows per micro-batch on its mesh) and on responses the
    served model's context cuts.

  Raises:
    PreflightError: every problem found, each naming its field(s) and a value that would work.
  """
  checks = CHECKS.get(type(cfg).__name__)
  if checks is None:
    raise TypeError(f"preflight: no checks declared for {type(cfg).__name__}")
  devices = jax.device_count()
  problems = [p for name in checks.meshes
              if (p := _mesh_problem(name, field(cfg, name), devices)) is not None]
  problems += _paths(cfg, checks)
  length_problems, notes = _lengths(cfg, checks)
  problems += length_problems
  if not problems:
    problems += _anchor(cfg)
  if problems:
    raise PreflightError(" | ".join(problems))
  for rows_field, mesh_field in checks.rows:
    mesh = field(cfg, mesh_field).make()
    rows, shards = field(cfg, rows_field), parallel.batch_shards(mesh)
    notes.append(f"{rows_field}={rows} -> {parallel.rows_for_mesh(rows, shards)} rows per "
                 f"micro-batch on mesh {dict(mesh.shape)} (data x fsdp = {shards})")
  return notes


def writable_problem(label: str, path: str) -> str | None:
  """Why the command cannot write ``path`` (a directory it creates, or a file), or None.

  Probes with a hidden file of a random name in ``path`` or its nearest existing parent (local or
  a URL's file system), created and removed at once: permission bits, a read-only mount, root's
  rights and a bucket's permissions all answer as they would for the run.
  """
  if not path:
    return f"{label}: not set (the output path is required)"
  p = paths.as_path(path).expanduser().absolute()
  where = next(a for a in (p, *p.parents) if a.exists())
  if not where.is_dir():
    return f"{label}={path!r}: {where} is a file, not a directory"
  try:
    probe = where / f".disa_write_probe_{uuid.uuid4().hex}"
    probe.write_bytes(b"")
    probe.unlink()
  except OSError as e:
    return f"{label}={path!r}: cannot write in {where} ({e.strerror or e})"
  return None


def require_writable(outputs: dict[str, str]) -> None:
  """`writable_problem` for each ``{label: path}``.

  Raises:
    PreflightError: every path that cannot be written, named by its label.
  """
  problems = [p for label, path in outputs.items() if (p := writable_problem(label, path))]
  if problems:
    raise PreflightError(" | ".join(problems))


class _Checked(Exception):
  """Stops a stage's claim function right after its identity check (a dry run writes nothing)."""


def _check_only(real: Callable[..., str]) -> Callable[..., str]:
  """`identity.claim_output` that only checks: against a scratch copy of the stored identity,
  never discarding (``overwrite`` asks for a discard: nothing to refuse), then `_Checked`."""

  def check(path, ident, *, overwrite, has_output, discard, recorded=None, locations=()):
    del discard
    path = paths.as_path(path)
    if not overwrite and (path.exists() or has_output):
      with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp) / path.name
        if path.exists():
          scratch.write_bytes(path.read_bytes())
        try:
          real(scratch, ident, overwrite=False, has_output=has_output, discard=lambda: None,
               recorded=recorded, locations=locations)
        except identity.IdentityMismatchError as e:
          raise identity.IdentityMismatchError(path, e.diffs) from None
        except ValueError as e:  # an unreadable identity file, named by its scratch copy
          raise ValueError(str(e).replace(str(scratch), str(path))) from None
    raise _Checked()

  return check


def _claim_checked(claim: Callable[[Any], Any], cfg: Any) -> None:
  """Runs the stage's claim function with `identity.claim_output` in check-only mode."""
  real = identity.claim_output
  identity.claim_output = _check_only(real)
  try:
    claim(cfg)
  except _Checked:
    pass
  finally:
    identity.claim_output = real


def claim_evaluation_outputs(cfg: Any) -> None:
  """The evaluation's identity check (`workflows.evaluation`'s per-benchmark claim), every
  benchmark in turn: each check stops its claim (`_Checked`). Only for ``model_path``: the
  checkpoint of a ``run_dir`` is chosen and exported by the run."""
  evaluation = _resolve("disa_jax.workflows.evaluation:_claim_benchmarks")
  for name, path in cfg.benchmarks.items() if cfg.model_path else ():
    if path:
      one = dataclasses.replace(cfg, benchmarks={name: path})
      try:
        evaluation(one, one.model_path, paths.as_path(one.output_dir))
      except _Checked:
        pass


def _resolve(dotted: str) -> Callable[..., Any]:
  """``'module:function'`` -> the function (imported when a command needs it: a workflow module
  may import this one)."""
  module, _, function = dotted.partition(":")
  return getattr(importlib.import_module(module), function)


def _exists(path: str) -> bool:
  """Whether ``path`` or a sibling named after it (``<path>.identity.json``, ``.ckpt``) exists."""
  p = paths.as_path(path).expanduser().absolute()
  return p.exists() or (p.parent.is_dir()
                        and any(c.name.startswith(p.name + ".") for c in p.parent.iterdir()))


def check_outputs(cfg: Any, *, claims: bool = True) -> None:
  """Checks the command's outputs: set and writable, and (``claims``) that a rerun into them
  resumes the same work (the stage's own claim function, writing nothing; only where an output
  exists: hashing the inputs costs what the run's own check costs). A config type without
  `CHECKS` outputs passes.

  Raises:
    PreflightError: an output field unset or not writable (named).
    IdentityMismatchError: the outputs hold another run's results and ``overwrite`` is off (names
      every differing field, and ``overwrite``).
  """
  checks = CHECKS.get(type(cfg).__name__, Checks())
  require_writable({name: field(cfg, name) for name in checks.outputs})
  if claims and checks.claim and any(_exists(field(cfg, n)) for n in checks.outputs):
    _claim_checked(_resolve(checks.claim), cfg)
