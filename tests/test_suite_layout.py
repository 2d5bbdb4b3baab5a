"""The suite's scheduling (tests/conftest.py): the heavy groups it names exist, and a module's tests
run on one xdist worker, its module fixtures set up once."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests import conftest

ROOT = Path(__file__).resolve().parents[1]


def test_every_heavy_group_names_an_existing_module_or_parametrization():
  for group in conftest.HEAVY:
    module, _, part = group.partition("::")
    path = ROOT / module
    assert path.is_file(), f"HEAVY names {module}, which does not exist"
    if part:  # a group of its own: one parametrization of a PER_PARAMETER module
      assert module in conftest.PER_PARAMETER, (group, "its module is not in PER_PARAMETER")
      assert f'"{part}"' in path.read_text(), (group, "no such parameter in the module")


def test_heavy_groups_are_listed_once():
  assert len(set(conftest.HEAVY)) == len(conftest.HEAVY)


def test_groups_follow_the_node_id():
  g = conftest._group  # pylint: disable=protected-access
  assert g("tests/test_main_job.py::test_notebooks_open_the_run[a.ipynb]") == "tests/test_main_job.py"
  assert g("tests/rl/test_x.py::TestA::test_b") == "tests/rl/test_x.py"
  assert (g("tests/workflows/test_fault_matrix.py::test_kill9_at_random_moments_then_rerun_is_"
            "bit_identical[stage3]") == "tests/workflows/test_fault_matrix.py::stage3")


MODULE = '''
import os
import pytest

@pytest.fixture(scope="module")
def once(tmp_path_factory):
  with open(os.environ["SETUPS"], "a") as f:
    f.write(__name__ + "\\n")

@pytest.mark.parametrize("i", range(5))
def test_t(once, i):
  with open(os.environ["RAN"], "a") as f:
    f.write(f"{__name__} {os.environ['PYTEST_XDIST_WORKER']}\\n")
'''


def test_a_modules_tests_share_one_worker_and_its_module_fixture(tmp_path):
  """Under the README's ``-n 2 --dist loadgroup``, with this suite's conftest: before the scheduler
  in conftest.py, pytest 9 spread a module's tests over both workers."""
  tests = tmp_path / "tests"
  tests.mkdir()
  shutil.copy(ROOT / "tests" / "conftest.py", tests / "conftest.py")
  (tests / "__init__.py").write_text("")
  for name in ("test_one", "test_two"):
    (tests / f"{name}.py").write_text(MODULE)
  env = dict(os.environ, SETUPS=str(tmp_path / "setups"), RAN=str(tmp_path / "ran"),
             PYTHONPATH=str(ROOT))
  out = subprocess.run([sys.executable, "-m", "pytest", "tests", "-n", "2", "--dist", "loadgroup",
                        "-p", "no:cacheprovider", "-q"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  ran = [l.split() for l in (tmp_path / "ran").read_text().splitlines()]
  assert len(ran) == 10
  workers = {m: {w for mm, w in ran if mm == m} for m, _ in ran}
  assert all(len(w) == 1 for w in workers.values()), workers
  setups = (tmp_path / "setups").read_text().splitlines()
  assert sorted(setups) == sorted(workers), setups  # each module fixture once
