"""The tiny Stage 3 trainer of tests/rl/test_trainer.py with its engine in its own process.

Usage: stage3_worker.py WORKDIR STEPS MODEL_DIR [--soak] [--staleness K]

The policy, pi_ref and the generation process all load MODEL_DIR (an HF save of the tiny model), so
every run starts from the same weights; a rerun resumes from WORKDIR's latest checkpoint. Prints
``ENGINE_PID <pid>`` once the generation process runs. With ``--soak`` it checkpoints and measures
every 10 steps, logging the trainer's and the generation process's resident memory, the shared memory each has
mapped, and /dev/shm's usage (``soak/*`` in metrics.jsonl) through the trainer's ``measures`` hook.
"""
import dataclasses
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from disa_jax import runtime  # noqa: E402

runtime.tune_host_allocator()


from disa_jax import models  # noqa: E402
from disa_jax.rl.build import build_trainer  # noqa: E402
from disa_jax.rl.inputs import AnchorInput, EngineLink, StepModels  # noqa: E402
from disa_jax.rollout import make_engine, shm  # noqa: E402
from tests.rl import test_trainer as tt  # noqa: E402


def _rss_mb(pid: int) -> float:
  with open(f"/proc/{pid}/status", encoding="ascii") as f:
    kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
  return kb / 1024.0


def _shm_mapped_mb(pid: int) -> float:
  """This run's shared memory as mapped by process ``pid``: the rings and weight block (unlinked
  once both processes have attached them, so they are found in the maps, not in /dev/shm)."""
  total = 0
  with open(f"/proc/{pid}/maps", encoding="ascii", errors="replace") as f:
    for line in f:
      if f"/dev/shm/{shm.PREFIX}" in line:
        lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
        total += hi - lo
  return total / 2 ** 20


def _dev_shm_used_mb() -> float:
  st = os.statvfs("/dev/shm")
  return (st.f_blocks - st.f_bfree) * st.f_frsize / 2 ** 20


def main():
  workdir, steps, model_dir = sys.argv[1], int(sys.argv[2]), sys.argv[3]
  soak = "--soak" in sys.argv[4:]
  cfg = tt._cfg(steps=steps)  # pylint: disable=protected-access
  if "--staleness" in sys.argv[4:]:  # asynchronous rollouts, k batches ahead
    k = int(sys.argv[sys.argv.index("--staleness") + 1])
    cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, max_staleness=k))
  if soak:
    cfg = dataclasses.replace(
        cfg, validation=dataclasses.replace(cfg.validation, every=10),
        checkpoint=dataclasses.replace(cfg.checkpoint, every=10))
  policy = models.from_pretrained(model_dir)
  with make_engine("jax", model_dir) as engine:
    print("ENGINE_PID", engine.pid, flush=True)  # (--staleness: kill -9 tests kill the trainer)
    measures = None
    if soak:
      measures = lambda step: {"soak/rss_trainer_mb": _rss_mb(os.getpid()),
                          "soak/rss_engine_mb": _rss_mb(engine.pid),
                          "soak/shm_mapped_trainer_mb": _shm_mapped_mb(os.getpid()),
                          "soak/shm_mapped_engine_mb": _shm_mapped_mb(engine.pid),
                          "soak/dev_shm_used_mb": _dev_shm_used_mb()}
    trainer = build_trainer(
        cfg, workdir, StepModels(policy, models.from_pretrained(model_dir), tt._mesh1(), pad_to=16),  # pylint: disable=protected-access
        tt._task(validation_prompts=tt._prompts(2)), EngineLink(engine),  # pylint: disable=protected-access
        AnchorInput(tt._anchor(policy.config.hidden_size, beta=cfg.objective.beta)),  # pylint: disable=protected-access
        measures=measures)
    try:
      trainer.run()
    finally:
      trainer.close()


if __name__ == "__main__":
  main()
