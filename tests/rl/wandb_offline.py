"""Reads what wandb's offline mode wrote, as `wandb sync` would upload it (test helper).

wandb's offline run file ``run-<id>.wandb`` is a record log: 32 KiB blocks of CRC-framed
protobuf `Record`s (7-byte header ':W&B' + magic + version, then 7-byte record headers:
CRC32, length, kind = full | first | middle | last).
"""
from __future__ import annotations

import glob
import json
import os
import struct

from wandb.proto import wandb_internal_pb2 as pb

_BLOCK = 32768  # wandb's record log: LevelDB-style blocks
_HEADER = 7  # ':W&B' + magic (2 bytes) + version (1 byte); then 7-byte record headers


def records(path: str):
  """Yields the serialized records of one ``run-<id>.wandb`` file."""
  with open(path, "rb") as f:
    data = f.read()
  assert data[:4] == b":W&B", f"{path}: not a wandb record log ({data[:7]!r})"
  pos, pending = _HEADER, b""
  while pos + 7 <= len(data):
    left = _BLOCK - pos % _BLOCK
    if left < 7:  # block trailer padding
      pos += left
      continue
    _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
    pos += 7
    chunk, pos = data[pos:pos + length], pos + length
    if kind == 1:  # full
      yield chunk
    elif kind == 2:  # first
      pending = chunk
    elif kind == 3:  # middle
      pending += chunk
    elif kind == 4:  # last
      yield pending + chunk


def offline_runs(workdir) -> list[dict]:
  """Each offline run folder's run id, config and history rows (step -> metrics)."""
  runs = []
  for path in sorted(glob.glob(os.path.join(str(workdir), "wandb", "offline-run-*", "*.wandb"))):
    run = {"id": None, "config": {}, "history": {}, "tags": []}
    for raw in records(path):
      rec = pb.Record()
      rec.ParseFromString(raw)
      kind = rec.WhichOneof("record_type")
      if kind == "run":
        run["id"], run["tags"] = rec.run.run_id, list(rec.run.tags)
        run["config"].update({u.key: json.loads(u.value_json) for u in rec.run.config.update})
      elif kind == "config":
        run["config"].update({u.key: json.loads(u.value_json) for u in rec.config.update})
      elif kind == "history":
        row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
        run["history"][row.pop("_step")] = {k: v for k, v in row.items() if not k.startswith("_")}
    runs.append(run)
  return runs


def isolate_wandb(tmp_path, monkeypatch) -> None:
  """Keeps wandb's settings and caches inside the test's directory, silent and offline."""
  for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
    monkeypatch.setenv(var, str(tmp_path / "wandb_home" / var.lower()))
  monkeypatch.setenv("WANDB_SILENT", "true")
  monkeypatch.delenv("WANDB_MODE", raising=False)
