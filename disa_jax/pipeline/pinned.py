"""The main job's tiny models, pinned: built once, committed, and copied into every job's workdir.

XLA's CPU code differs by processor, so pi_ref and p_T trained from the same spec on two machines
are two different models (issue 62: the anchor testbed existed in three builds). A pin is one
directory of the store `STORE` per model identity (`PinIdentity`: the architecture, the task's
range and both warm-up specs), named by the first 16 hex digits of that identity's sha256::

    <STORE>/<key>/pin.json         the identity, each file's sha256 and size, each model's
                                   fingerprint (`disa_jax.checkpoint.identity.fingerprint`), where
                                   and how long it was built
    <STORE>/<key>/reference/       pi_ref as `SumJob.build_models` saved it (HF checkpoint,
    <STORE>/<key>/proposal/        tokenizer, warmup.json); p_T likewise

`provide` puts the models of a job in its workdir: the pinned ones (each file checked against its
recorded sha256 first: a changed file is refused, naming it and both hashes), or, with
``rebuild_models`` or where no pin exists, the models trained on this machine (saying whether the
hash differs from the pin's). ``<workdir>/models/pinned.json`` records which, and a resumed job is
checked against it. `pin` writes a store entry from a workdir's models (launch/pin_models.py).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import platform
import shutil
import time
from pathlib import Path
from typing import Callable

from disa_jax import artifacts, codec
from disa_jax.checkpoint.identity import fingerprint
from disa_jax.pipeline.job_config import MainConfig
from disa_jax.pipeline.sum_models import TinyLMSpec, WarmupSpec

STORE = Path(__file__).resolve().parent / "pinned_models"
MODELS = ("reference", "proposal")
RECORD = "pinned.json"  # in the workdir's models/ directory: where its models came from


class PinnedModelError(ValueError):
  """A pinned or a workdir's model is not what its record says (the message names the file)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class PinIdentity:
  """What makes two builds of a job's models the same models (on one machine): the architecture,
  the task's range and both warm-up specs. `key` names its store entry: the first 16 hex digits of
  the sha256 of its JSON form (sorted keys)."""
  arch: TinyLMSpec
  task: tuple[int, int]  # the task's (n_min, n_max)
  reference: WarmupSpec
  proposal: WarmupSpec

  @property
  def key(self) -> str:
    return hashlib.sha256(json.dumps(codec.encode(self), sort_keys=True).encode()).hexdigest()[:16]


def identity(cfg: MainConfig) -> PinIdentity:
  return PinIdentity(arch=cfg.arch, task=(cfg.task.n_min, cfg.task.n_max),
                     reference=cfg.reference_model, proposal=cfg.proposal_model)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PinnedFile:
  sha256: str
  bytes: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class PinRecord:
  """A store entry's ``pin.json``: its key and identity, each file's sha256 and size (paths
  relative to the entry), each model's fingerprint, their total size, where and how long (seconds
  of warm-up) the models were built."""
  key: str
  identity: PinIdentity
  files: dict[str, PinnedFile]
  fingerprint: dict[str, str]
  bytes: int
  built_on: str
  build_seconds: float

  FILE = "pin.json"


def _file_hash(path: Path) -> str:
  return hashlib.sha256(path.read_bytes()).hexdigest()


def _files(model_dir: Path) -> dict[str, Path]:
  return {p.relative_to(model_dir).as_posix(): p for p in sorted(model_dir.rglob("*"))
          if p.is_file() and not p.name.startswith(".")}


def cpu_name() -> str:
  """The processor's model name (/proc/cpuinfo on Linux; else `platform.processor`)."""
  try:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
      if line.startswith("model name"):
        return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


def verify(pin_dir: Path) -> PinRecord:
  """The ``pin.json`` of ``pin_dir`` after checking every file it lists against its sha256; raises
  `PinnedModelError` naming the first changed or missing file and both hashes."""
  record = codec.load(PinRecord, pin_dir / PinRecord.FILE, "pinned models")
  for rel, want in record.files.items():
    path = pin_dir / rel
    if not path.is_file():
      raise PinnedModelError(f"pinned model file {path} is missing (pin.json records sha256 "
                             f"{want.sha256})")
    got = _file_hash(path)
    if got != want.sha256:
      raise PinnedModelError(f"pinned model file {path} has sha256 {got}, but pin.json records "
                             f"{want.sha256}: restore it (git checkout) or rebuild with "
                             "--config.rebuild_models=True")
  return record


def pin(models_dir: Path, ident: PinIdentity, *, store: Path | None = None) -> Path:
  """Writes the store entry of ``ident`` from the models in ``models_dir`` (``reference/`` and
  ``proposal/``, saved by `SumJob.build_models`), replacing an older one; returns its directory."""
  seconds = sum(artifacts.read_json(models_dir / m / "warmup.json", "warm-up record")["seconds"]
                for m in MODELS)
  out = (store or STORE) / ident.key
  tmp = out.with_name(out.name + ".tmp")
  shutil.rmtree(tmp, ignore_errors=True)
  files = {}
  for m in MODELS:
    shutil.copytree(models_dir / m, tmp / m)
    files |= {f"{m}/{rel}": PinnedFile(sha256=_file_hash(p), bytes=p.stat().st_size)
              for rel, p in _files(tmp / m).items()}
  codec.save(PinRecord(key=out.name, identity=ident, files=files,
                       fingerprint={m: fingerprint(tmp / m) for m in MODELS},
                       bytes=sum(f.bytes for f in files.values()), built_on=cpu_name(),
                       build_seconds=round(seconds, 1)), tmp / PinRecord.FILE)
  shutil.rmtree(out, ignore_errors=True)
  tmp.rename(out)
  return out


@dataclasses.dataclass(frozen=True)
class ModelSource:
  """Where a job's models came from (``models/pinned.json``; the report's provenance).

  Attributes:
    source: 'pinned' (copied from the store) or 'trained' (on this machine).
    key: the store entry of the job's model identity ('' where none exists).
    fingerprint: each model's directory fingerprint in the workdir.
    pinned_fingerprint: each model's fingerprint in the store ({} where there is no pin).
  """
  source: str
  key: str
  fingerprint: dict[str, str]
  pinned_fingerprint: dict[str, str]


def _check_resumed(models_dir: Path, src: ModelSource, rebuild: bool) -> ModelSource:
  """The workdir's models as recorded (``src``), refused when a file changed or when they were
  trained here while a pin exists and ``rebuild`` is off."""
  now = {m: fingerprint(models_dir / m) for m in MODELS}
  for m in MODELS:
    if now[m] != src.fingerprint[m]:
      raise PinnedModelError(f"{models_dir / m} has fingerprint {now[m]}, but {models_dir / RECORD} "
                             f"records {src.fingerprint[m]}: use another workdir or delete it")
  if src.source == "pinned" and rebuild:
    raise PinnedModelError(f"{models_dir} holds the pinned models {src.key}: "
                           "--config.rebuild_models=True trains new ones in a fresh workdir")
  if src.source == "trained" and src.pinned_fingerprint and not rebuild:
    raise PinnedModelError(f"{models_dir} holds models trained on this machine (reference "
                           f"{now['reference'][:16]}), not the pinned ones (reference "
                           f"{src.pinned_fingerprint['reference'][:16]}): use another workdir, or "
                           "--config.rebuild_models=True to keep them")
  return src


def _copy_pinned(pin_dir: Path, models_dir: Path, m: str, want: str, key: str) -> None:
  """Copies model ``m`` of the pin into ``models_dir`` whole or not at all (a temporary folder,
  renamed): a job killed mid-copy leaves a ``.partial`` folder, removed by the rerun. A model
  already there is kept only if it is the pin's (a copy that finished before a kill)."""
  dest, tmp = models_dir / m, models_dir / f"{m}.partial"
  if dest.exists():
    if fingerprint(dest) == want:
      return
    raise PinnedModelError(f"{models_dir} holds models without {RECORD} (trained before models "
                           f"were pinned), not the pin {key}: use another workdir, or "
                           "--config.rebuild_models=True to keep them")
  shutil.rmtree(tmp, ignore_errors=True)
  shutil.copytree(pin_dir / m, tmp)
  tmp.rename(dest)


def provide(models_dir: Path, ident: PinIdentity, *, rebuild: bool,
            train: Callable[[], None], store: Path | None = None,
            log: Callable[[str], None] | None = None) -> ModelSource:
  """The job's models in ``models_dir`` (``reference/``, ``proposal/``), recorded in
  ``models_dir/pinned.json``: kept when recorded there (a resumed job), else copied from the pin
  of ``ident`` in ``store`` (checked file by file: `verify`), else, with ``rebuild`` or without a
  pin, made by ``train()`` (which saves both), logging whether the hash changed."""
  record_path = models_dir / RECORD
  if record_path.exists():
    return _check_resumed(models_dir, codec.load(ModelSource, record_path, "the models' record"),
                          rebuild)
  key = ident.key
  pin_dir = (store or STORE) / key
  pinned = verify(pin_dir) if pin_dir.is_dir() else None
  if pinned is not None and not rebuild:
    for m in MODELS:
      _copy_pinned(pin_dir, models_dir, m, pinned.fingerprint[m], key)
    src = ModelSource("pinned", key, {m: fingerprint(models_dir / m) for m in MODELS},
                      dict(pinned.fingerprint))
  else:
    t0 = time.time()
    train()
    fp = {m: fingerprint(models_dir / m) for m in MODELS}
    src = ModelSource("trained", key if pinned else "", fp,
                      dict(pinned.fingerprint) if pinned else {})
    for m in MODELS:
      old = src.pinned_fingerprint.get(m)
      (log or print)(f"models: {m} made on this machine ({time.time() - t0:.0f} s), fingerprint "
          f"{fp[m][:16]}" + ("" if old is None else f"; the pin {key} holds {old[:16]}: "
                              + ("the same" if old == fp[m] else "the hash changed")))
  codec.save(src, record_path)
  return src
