"""Runs a stage and kills itself with SIGKILL at a named point (fault injection).

Usage: kill_worker.py {stage1|stage2|stage3|eval} CONFIG_JSON POINT
       kill_worker.py serve     (a fork server: `tests.workflows.fork_server`)

Stage 3 and evaluation take POINT 'none' only (the fault matrix kills them from outside).

CONFIG_JSON is the `Stage1Config` / `Stage2Config` as a dict (`disa_jax.config.to_dict`). POINT is
'none' (run to the end) or one of:

Stage 1 (the k-th durable write of the Stage 1 dataset, k >= 1):
- 'after_write:k': right after the k-th write returned (between batches).
- 'mid_write:k': inside the k-th write, as a kill in the middle of writing the batch leaves it:
  jsonl: the first record's line and half of the second's are on disk; parquet: half of the part
  file's bytes are in its temporary file.

Stage 2:
- 'mid_fit': inside the anchor fit (its jitted epochs ran in memory; nothing is on disk yet).
- 'mid_anchor_save': the anchor's weights are written, its metadata file is not yet in place.
- 'after_anchor_save': the anchor is saved, the Stage 2 summary is not yet written.

The kill is `os.kill(os.getpid(), SIGKILL)`: no handler, no flush, no atexit, as kill -9 from outside.
"""
import json
import os
import signal
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _die() -> None:
  sys.stdout.flush()
  os.kill(os.getpid(), signal.SIGKILL)


def _stage1_hooks(point: str) -> None:
  from disa_jax.estimators import dataset  # pylint: disable=g-import-not-at-top
  kind, _, k = point.partition(":")
  k = int(k)
  original = dataset.Stage1Writer.write
  calls = [0]

  def write(self, records):
    records = list(records)
    calls[0] += 1
    if calls[0] != k:
      return original(self, records)
    if kind == "after_write":
      n = original(self, records)
      _die()
      return n
    assert len(records) >= 2, "mid_write needs a batch of at least 2 prompts"
    if self.fmt == "jsonl":
      with open(self.path, "a", encoding="utf-8") as f:
        f.write(json.dumps(records[0], default=dataset._json_default, allow_nan=True) + "\n")  # pylint: disable=protected-access
        line = json.dumps(records[1], default=dataset._json_default, allow_nan=True)  # pylint: disable=protected-access
        f.write(line[:len(line) // 2])
        f.flush()
        os.fsync(f.fileno())
    else:
      import io  # pylint: disable=g-import-not-at-top
      import pyarrow as pa  # pylint: disable=g-import-not-at-top
      import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
      rows = [dict(r, reward_transform=json.dumps(r["reward_transform"])) for r in records]
      buf = io.BytesIO()
      pq.write_table(pa.Table.from_pylist(rows), buf)
      part = len(list(self.path.glob("part-*.parquet")))
      data = buf.getvalue()
      (self.path / f"part-{part:06d}.parquet.tmp").write_bytes(data[:len(data) // 2])
    _die()

  if kind not in ("after_write", "mid_write"):
    raise SystemExit(f"unknown Stage 1 kill point {point!r}")
  dataset.Stage1Writer.write = write


def _stage2_hooks(point: str) -> None:
  from disa_jax.anchor import fit, frozen  # pylint: disable=g-import-not-at-top
  if point == "mid_fit":
    train = fit._train  # pylint: disable=protected-access

    def dies_in_the_fit(*args, **kwargs):  # the epochs ran in memory; nothing is on disk yet
      train(*args, **kwargs)
      _die()

    fit._train = dies_in_the_fit  # pylint: disable=protected-access
  elif point == "mid_anchor_save":
    from disa_jax import paths  # frozen.py moves its metadata file in place with paths.replace
    real_replace = paths.replace

    def replace(src, dst):  # the metadata file's final rename never happens
      if str(dst).endswith(frozen.META_FILE):
        _die()
      return real_replace(src, dst)

    paths.replace = replace
  elif point == "after_anchor_save":
    original = frozen.Anchor.save

    def save(self, directory):
      out = original(self, directory)
      _die()
      return out

    frozen.Anchor.save = save
  else:
    raise SystemExit(f"unknown Stage 2 kill point {point!r}")


def run(stage: str, config: dict, point: str) -> None:
  """Runs ``stage`` on ``config`` (a kill ``point`` armed) and prints its SUMMARY line."""
  if stage == "stage1":
    from disa_jax.workflows.stage1 import Stage1Config, run_stage1  # pylint: disable=g-import-not-at-top
    if point != "none":
      _stage1_hooks(point)
    summary = run_stage1(Stage1Config.from_config(config)).to_json()
  elif stage == "stage2":
    from disa_jax.workflows.stage2 import Stage2Config, run_stage2  # pylint: disable=g-import-not-at-top
    if point != "none":
      _stage2_hooks(point)
    summary = run_stage2(Stage2Config.from_config(config)).to_json()
  elif stage in ("stage3", "eval") and point == "none":
    from disa_jax.workflows.evaluation import EvalConfig, run_evaluation  # pylint: disable=g-import-not-at-top
    from disa_jax.workflows.stage3 import Stage3Config, run_stage3  # pylint: disable=g-import-not-at-top
    summary = (run_stage3(Stage3Config.from_config(config)) if stage == "stage3"
               else run_evaluation(EvalConfig.from_config(config))).to_json()
  else:
    raise SystemExit(f"unknown stage {stage!r} or point {point!r}")
  print("SUMMARY " + json.dumps({k: summary[k] for k in ("run", "resumed") if k in summary}),
        flush=True)


def main():
  from disa_jax.workflows import evaluation, stage1, stage2, stage3  # pylint: disable=g-import-not-at-top,unused-import
  if sys.argv[1] == "serve":  # a fork server of workers that start after the imports
    from tests.workflows import fork_server  # pylint: disable=g-import-not-at-top
    fork_server.serve(lambda request: run(request["stage"], request["config"], request["point"]))
    return
  stage, config_json, point = sys.argv[1], sys.argv[2], sys.argv[3]
  config = json.loads(config_json)
  print("START", flush=True)  # imports done: the stage's own work begins (the fault matrix times it)
  run(stage, config, point)


if __name__ == "__main__":
  main()
