"""The two entry commands (launch/main.sh, launch/test.sh) and the install step they share.

`launch/install.sh` calls pip only when `launch/check_env.py` finds the venv incomplete for the
requested extras or older than pyproject.toml; these tests check that decision on this checkout and
on edited copies of its pyproject.toml, and that a second install call does not reach pip.
"""
import importlib.metadata
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from launch import check_env

ROOT = pathlib.Path(__file__).resolve().parents[1]
IN_PROJECT_VENV = pathlib.Path(sys.prefix).resolve() == (ROOT / ".venv").resolve()


def test_this_environment_is_complete_for_the_test_extras():
  assert check_env.problems(["test"]) == []


def _edited_root(tmp_path, old, new):
  (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text().replace(old, new, 1))
  return str(tmp_path)


def test_a_missing_or_too_old_requirement_and_an_edited_pyproject_are_found(tmp_path):
  root = _edited_root(tmp_path, '"numpy>=1.26",', '"numpy>=1.26",\n  "no-such-package-xyz>=1",')
  found = check_env.problems(["test"], root=root)
  assert "no-such-package-xyz: not installed (wanted no-such-package-xyz>=1)" in found
  assert any("installed metadata predates this pyproject.toml" in p for p in found), found
  assert any(p.startswith("disa_jax: not an editable install of") for p in found), found  # tmp copy
  root = _edited_root(tmp_path, '"numpy>=1.26"', '"numpy>=999"')
  assert any(p.startswith("numpy: ") and "wants numpy>=999" in p
             for p in check_env.problems([], root=root))
  root = _edited_root(tmp_path, '"pytest>=8.0"', '"pytest>=999"')
  assert check_env.problems([], root=root)[-1].startswith("disa_jax: installed metadata")
  assert any("wants pytest>=999" in p for p in check_env.problems(["test"], root=root))


def test_an_unknown_extra_is_one_error_line():
  out = subprocess.run([sys.executable, str(ROOT / "launch" / "check_env.py"), "test,nosuch"],
                       capture_output=True, text=True, timeout=60)
  assert out.returncode == 1 and out.stdout == ""
  assert out.stderr.strip().startswith("error: unknown extra(s) ['nosuch']"), out.stderr


@pytest.mark.skipif(not IN_PROJECT_VENV, reason="needs the repository's own .venv (launch/install.sh)")
def test_a_second_install_call_skips_pip(tmp_path):
  """pip is shadowed by a script that fails: the call must not reach it."""
  fake = tmp_path / "bin"
  fake.mkdir()
  (fake / "pip").write_text("#!/bin/sh\necho pip was called >&2\nexit 9\n")
  (fake / "pip").chmod(0o755)
  env = dict(os.environ, PATH=f"{fake}:{os.environ['PATH']}", PIP_INDEX_URL="http://127.0.0.1:9/")
  out = subprocess.run(["bash", str(ROOT / "launch" / "install.sh")], env=env, capture_output=True,
                       text=True, timeout=120)
  assert out.returncode == 0, out.stderr
  assert "nothing to install" in out.stdout and "pip was called" not in out.stderr


def _entry_argv(tmp_path, script, *args):
  """What launch/<script> would exec, with .venv/bin/python replaced by an echo."""
  copy = tmp_path / f"repo_{len(list(tmp_path.iterdir()))}"
  (copy / "launch").mkdir(parents=True)
  shutil.copy(ROOT / "launch" / script, copy / "launch" / script)
  (copy / "launch" / "install.sh").write_text("echo installed\n")
  (copy / ".venv" / "bin").mkdir(parents=True)
  (copy / ".venv" / "bin" / "python").write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
  (copy / ".venv" / "bin" / "python").chmod(0o755)
  out = subprocess.run(["bash", str(copy / "launch" / script), *args], capture_output=True,
                       text=True, timeout=60)
  assert out.returncode == 0, out.stderr
  lines = out.stdout.splitlines()
  assert lines[0] == "installed"  # the install step runs first, every time
  return lines[1:]


def test_main_sh_installs_then_runs_the_main_job_with_a_default_workdir(tmp_path):
  assert _entry_argv(tmp_path, "main.sh") == ["-m", "launch.main", "--workdir=/tmp/disa_main"]
  assert _entry_argv(tmp_path, "main.sh", "--workdir=/x", "--config.train.total_steps=5") == [
      "-m", "launch.main", "--workdir=/x", "--config.train.total_steps=5"]


def test_test_sh_runs_the_readme_test_command_and_ci_calls_it(tmp_path):
  argv = _entry_argv(tmp_path, "test.sh", "-m", "not slow")
  readme = (ROOT / "README.md").read_text()
  command = " ".join(argv[:-2])
  assert f".venv/bin/python {command}" in readme, command  # the README's test command
  assert argv[-2:] == ["-m", "not slow"]
  assert "bash launch/test.sh" in (ROOT / ".ci" / "run").read_text()
  top = readme.split("## ", 2)[1]  # the quick start, first section of the README
  assert "bash launch/main.sh" in top and "bash launch/test.sh" in top


def _install_commands(tmp_path, **env):
  """The commands launch/install.sh runs in a copy whose .venv/bin/python echoes its arguments
  (and fails as check_env.py, so that the install goes ahead)."""
  copy = tmp_path / "repo"
  (copy / "launch").mkdir(parents=True)
  shutil.copy(ROOT / "launch" / "install.sh", copy / "launch" / "install.sh")
  (copy / ".venv" / "bin").mkdir(parents=True)
  (copy / ".venv" / "bin" / "python").write_text(
      '#!/bin/sh\necho "python $*"\n[ "$1" = launch/check_env.py ] && [ ! -e "$0.seen" ] '
      '&& { touch "$0.seen"; exit 1; }\nexit 0\n')  # (the first check finds the venv stale)
  (copy / ".venv" / "bin" / "python").chmod(0o755)
  out = subprocess.run(["bash", str(copy / "launch" / "install.sh")], capture_output=True,
                       text=True, timeout=60, env=dict(os.environ, **env))
  assert out.returncode == 0, out.stderr
  return [l for l in out.stdout.splitlines() if l.startswith("python ")]


def test_install_pins_the_environment_by_default_and_unpinned_on_request(tmp_path):
  pip = [c for c in _install_commands(tmp_path / "a") if "pip install -q" in c and " -e " in c]
  assert len(pip) == 1 and " -c constraints.txt -e .[" in pip[0], pip
  cmds = _install_commands(tmp_path / "b", DISA_UNPINNED="1")
  pip = [c for c in cmds if "pip install -q" in c and " -e " in c]
  assert len(pip) == 1 and "constraints.txt" not in pip[0], pip
  assert all(c.endswith("--unpinned") for c in cmds if "check_env.py" in c), cmds


def test_check_env_flags_a_version_that_differs_from_its_pin(tmp_path):
  assert check_env.pin_problems() == []  # this venv is the one constraints.txt was frozen from
  numpy = next(l for l in (ROOT / "constraints.txt").read_text().splitlines()
               if l.startswith("numpy=="))
  pins = tmp_path / "constraints.txt"
  pins.write_text(f"# a comment\n{numpy}\nnumpy-not-installed-xyz==1.0\njax==0.0.1\n")
  assert check_env.pin_problems(str(pins)) == [
      f"jax: {importlib.metadata.version('jax')} installed, constraints.txt pins ==0.0.1"]
  for name in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "transformers", "numpy"):
    assert f"\n{name}==" in (ROOT / "constraints.txt").read_text(), name
