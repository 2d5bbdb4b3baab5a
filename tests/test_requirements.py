"""Optional requirements (the vLLM engine, ../shared data): skipped locally, failures under CI=true."""
import importlib.util
import os
import pathlib
import re
import subprocess
import sys

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
