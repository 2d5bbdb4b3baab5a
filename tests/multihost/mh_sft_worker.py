"""One process of the simulated two-host LoRA-SFT run used by `test_multihost_sft.py`.

Run as ``python mh_sft_worker.py sft WORKDIR`` with ``DISA_COORDINATOR``, ``DISA_NUM_PROCESSES``
and ``DISA_PROCESS_ID`` set: `run_lora_sft` on a 4-device mesh spanning both processes (2 CPU
devices each), from ``WORKDIR/ref`` and ``WORKDIR/s1.jsonl`` to ``WORKDIR/sft``.
"""
from __future__ import annotations

import os
import sys

import mh_worker  # this script's directory is on sys.path; mh_worker imports no JAX


def make_config():
  """The run's settings, shared with the single-process reference in the test."""
  from disa_jax.sft import baseline  # pylint: disable=g-import-not-at-top
  return baseline.LoRASFTConfig(rank=4, alpha=8.0, learning_rate=2e-2, batch_size=4,
                                micro_batch_rows=4, epochs=2, pad_to=16, checkpoint_every=1)


def main(workdir: str) -> None:
  from disa_jax.parallel import distributed  # pylint: disable=g-import-not-at-top
  distributed.initialize()
  import jax  # pylint: disable=g-import-not-at-top
  from disa_jax.parallel import make_mesh  # pylint: disable=g-import-not-at-top
  from disa_jax.sft import baseline  # pylint: disable=g-import-not-at-top

  assert jax.process_count() == 2 and len(jax.devices()) == 2 * mh_worker.DEVICES_PER_PROCESS
  summary = baseline.run_lora_sft(os.path.join(workdir, "ref"), os.path.join(workdir, "s1.jsonl"),
                                  os.path.join(workdir, "sft"), make_config(),
                                  mesh=make_mesh(fsdp=-1))
  assert not summary["skipped"], summary
  distributed.sync_global("sft_done")


if __name__ == "__main__":
  mh_worker.prepare_process()
  main(sys.argv[2])
