"""The LoRA-SFT baseline command (paper §4.2, App. D.4): reward-1 Stage 1 samples -> merged model.

`run_sft(SftConfig)` re-encodes the Stage 1 prompts exactly as Stage 1 did
(`disa_jax.workflows.stage1.encode_stage1_prompts`, i.e. `encode_prompt` under Stage 1's rendering),
then runs `disa_jax.sft.baseline.run_lora_sft`: LoRA on pi_ref, trained on the samples with
verifier reward 1, merged and exported as a Hugging Face directory at ``out_path``. A rerun resumes
from the adapter checkpoints under ``<out_path>.ckpt`` and does nothing once the export exists.
``<out_path>.identity.json`` records the inputs (reference and Stage 1 dataset with content hashes,
the SFT settings; `disa_jax.checkpoint.identity`): a rerun with others stops naming every differing
field, or with ``overwrite=True`` deletes the export and the adapter checkpoints and trains afresh.
One run at a time holds ``<out_path>.lock`` (process 0 of a multi-process run).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable, Mapping

from disa_jax import artifacts
from disa_jax import config as config_lib
from disa_jax import preemption
from disa_jax.checkpoint import identity
from disa_jax.checkpoint.lock import owned_output
from disa_jax.estimators import load_stage1
from disa_jax.parallel import distributed
from disa_jax.parallel.mesh import MeshConfig
from disa_jax.sft.baseline import SUMMARY_FILE, LoRASFTConfig, run_lora_sft
from disa_jax.workflows.stage1 import encode_stage1_prompts


@dataclasses.dataclass(frozen=True, kw_only=True)
class SftConfig(config_lib.Section):
  """Typed view of `configs/sft_paper.py` (the fields are documented there)."""

  reference_path: str
  stage1_path: str
  out_path: str
  mesh: MeshConfig = MeshConfig()
  sft: LoRASFTConfig = LoRASFTConfig()
  overwrite: bool = False

  def __post_init__(self):
    for name in ("reference_path", "stage1_path", "out_path"):
      if not getattr(self, name):
        raise ValueError(f"{name} is required (a local path), got ''")



@dataclasses.dataclass(frozen=True)
class SftRun:
  """The LoRA-SFT baseline: what `run_sft` returns; a finished one is persisted as
  ``<out_path>/sft_summary.json`` beside the merged export (`disa_jax.sft.baseline` writes it).

  Attributes:
    out_path: the merged HF export (absent while ``preempted``).
    preempted: the step a SIGTERM / SIGUSR1 stopped the training at (no export), else None.
    skipped: the export existed already (the call trained nothing).
    num_kept: the reward-1 samples trained on (None when preempted).
    steps: optimizer steps (None when preempted).
    loss_first, loss_last: the first and last step's loss (None without steps).
    summary: all of sft_summary.json (counts, truncations, packing, timings, the SFT config;
      `disa_jax.sft.baseline.run_lora_sft` owns its keys); empty when preempted.
  """
  out_path: Path
  preempted: int | None
  skipped: bool
  num_kept: int | None
  steps: int | None
  loss_first: float | None
  loss_last: float | None
  summary: Mapping[str, Any]

  @property
  def exported(self) -> bool:
    return self.preempted is None

  def to_json(self) -> dict[str, Any]:
    """`run_lora_sft`'s summary, as the command prints it."""
    if self.preempted is not None:
      return {"preempted": self.preempted, "out_path": str(self.out_path), "skipped": False}
    return dict(self.summary, skipped=self.skipped)

  @classmethod
  def from_json(cls, obj: Mapping[str, Any], path: str | Path, out_path: str | Path) -> "SftRun":
    f = lambda name, kind: artifacts.field(obj, name, path, kind)
    if obj.get("preempted") is not None:
      return cls(Path(out_path), f("preempted", int), False, None, None, None, None, {})
    opt_float = lambda name: f(name, (float, type(None)))
    return cls(Path(out_path), None, bool(obj.get("skipped", False)), f("num_kept", int),
               f("steps", int), opt_float("loss_first"), opt_float("loss_last"),
               {k: v for k, v in obj.items() if k != "skipped"})

  @classmethod
  def load(cls, out_path: str | Path) -> "SftRun":
    """The finished baseline exported at ``out_path``, as its run stored it."""
    path = Path(out_path) / SUMMARY_FILE
    return cls.from_json(artifacts.read_json(path, "the LoRA-SFT baseline"), path, out_path)


def claim_sft_output(cfg: SftConfig) -> str:
  """Records (or checks) ``<out_path>.identity.json``; `identity.claim_output`'s state."""
  out, ckpt = Path(cfg.out_path), Path(cfg.out_path + ".ckpt")
  ident = {**identity.inputs(reference_path=cfg.reference_path, stage1_path=cfg.stage1_path),
           "sft": config_lib.to_dict(cfg.sft), "mesh": config_lib.to_dict(cfg.mesh)}

  out.parent.mkdir(parents=True, exist_ok=True)
  return identity.claim_output(out.with_name(out.name + ".identity.json"), ident,
                               overwrite=cfg.overwrite, has_output=out.exists() or ckpt.exists(),
                               discard=lambda: identity.remove_paths([out, ckpt]))


def run_sft(cfg: SftConfig, log: Callable[[str], None] | None = None) -> SftRun:
  """Runs (or resumes, or finds finished) the LoRA-SFT baseline; returns it (`SftRun`, with
  ``preempted``, the step, when a SIGTERM / SIGUSR1 stopped it: `disa_jax.preemption`).

  Raises:
    OutputLockedError: another run holds ``out_path``.
    IdentityMismatchError: ``out_path`` holds a baseline of other inputs and ``overwrite`` is off.
  """
  owner = distributed.is_main_process()
  if owner:
    Path(cfg.out_path).parent.mkdir(parents=True, exist_ok=True)
  with owned_output(cfg.out_path + ".lock", f"the SFT baseline {cfg.out_path}",
                    lambda: claim_sft_output(cfg), owner=owner):
    return _run_sft(cfg, log)


def _run_sft(cfg: SftConfig, log: Callable[[str], None] | None) -> SftRun:
  """`run_sft` once the output is locked and its identity checked."""
  data = load_stage1(cfg.stage1_path)
  ids, _ = encode_stage1_prompts(cfg.stage1_path, cfg.reference_path, data)
  by_text = dict(zip(data.prompts, ids))  # the stored (rendered) text -> its ids
  with preemption.watch():
    summary = run_lora_sft(cfg.reference_path, cfg.stage1_path, cfg.out_path, cfg.sft,
                           encode_prompt=by_text.__getitem__, mesh=cfg.mesh.make(), log=log)
  return SftRun.from_json(summary, f"run_lora_sft({cfg.out_path!r})", cfg.out_path)
