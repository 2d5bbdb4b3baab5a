"""The code sandbox: basic execution, limits, and the hostile batteries of issues 4 and 24.

Every hostile program prints the expected output ("PWNED") only if its attack succeeded, so a
contained attack is a failed case. Each case also checks that the grader survived, that it returned
within its bound, that nothing was written outside the sandbox, and that no process of the sandbox
is left behind. The fork bomb is bounded to 16 processes of sleeping children for 3 s.
"""

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time
import uuid

import pytest

from disa_jax import testing
from disa_jax.rewards import code
from disa_jax.rewards import sandbox
from disa_jax.rewards._sandbox_boot import _pids_of_uid  # processes running as a uid
from tests.rewards import hostile_battery

PWNED = [{"input": "", "output": "PWNED"}]
# The positive control of each hostile case: a correct program, graded in the same configuration
# (timeout, limits), must pass, so a sandbox that fails everything cannot pass the hostile cases.
CORRECT = "print('PWNED')\n"


def _timed(fn, *args, **kwargs):
  t0 = time.perf_counter()
  out = fn(*args, **kwargs)
  return out, time.perf_counter() - t0


def _no_leftovers(stdout: bytes) -> bool:
  """No process is left of the sandbox whose program printed its uid as the first line."""
  uid = int(stdout.split()[0])
  assert uid != os.getuid()
  for _ in range(50):
    if not _pids_of_uid(uid):
      return True
    time.sleep(0.1)
  return False


def test_probed_mode_is_namespaces_when_root():
  mode = sandbox.sandbox_mode()
  assert mode in sandbox.MODES
  if os.geteuid() == 0 and os.path.exists("/usr/bin/unshare"):
    assert mode == "ns"


def test_runs_cases_with_stdin_and_private_dir():
  prog = ("import os, sys\n"
          "a, b = map(int, sys.stdin.read().split())\n"
          "open('scratch.txt', 'w').write(str(a + b))\n"
          "print(open('scratch.txt').read())\n"
          "print(os.getcwd() == os.environ['HOME'], sorted(os.environ), file=sys.stderr)\n")
  res = sandbox.run_cases({"p.py": prog}, "p.py", [b"1 2", b"10 20", b"x"], timeout_s=10)
  assert [r.stdout for r in res[:2]] == [b"3\n", b"30\n"]
  assert res[0].ok and res[1].ok and not res[2].ok and res[2].exit_code == 1
  assert b"ValueError" in res[2].stderr
  first_line = res[0].stderr.decode().splitlines()[0]
  assert first_line.startswith("True")
  assert "DISA" not in first_line and "XLA_FLAGS" not in first_line  # scrubbed environment


def test_exit_builtins_and_exit_codes():
  progs = {"a.py": "print('a')\nexit()\nprint('not reached')\n",
           "b.py": "quit(4)\n",
           "c.py": "import sys\nprint(__name__)\nsys.exit(3)\n"}
  res = [sandbox.run_cases(progs, name, [None], timeout_s=10)[0] for name in sorted(progs)]
  assert (res[0].exit_code, res[0].stdout) == (0, b"a\n")
  assert res[1].exit_code == 4
  assert (res[2].exit_code, res[2].stdout) == (3, b"__main__\n")


def test_run_cases_validation():
  with pytest.raises(ValueError, match="script"):
    sandbox.run_cases({"a.py": ""}, "b.py", [None], timeout_s=1)
  with pytest.raises(ValueError, match="bad file name"):
    sandbox.run_cases({"../a.py": ""}, "../a.py", [None], timeout_s=1)
  with pytest.raises(ValueError, match="timeout_s"):
    sandbox.run_cases({"a.py": ""}, "a.py", [None], timeout_s=0)
  with pytest.raises(ValueError, match="memory_mb"):
    sandbox.SandboxLimits(memory_mb=0)


def test_hostile_fork_bomb_is_contained():
  lim = sandbox.SandboxLimits(nproc=16, cpu_s=5)
  res, dt = _timed(sandbox.run_cases, {"p.py": hostile_battery.fork_bomb_program(16)}, "p.py",
                   [None], timeout_s=3.0, limits=lim)
  assert res[0].ok and res[0].stdout.split(b"\n")[1].startswith(b"blocked")
  assert dt < 15.0
  assert _no_leftovers(res[0].stdout)  # its sleeping children died with the case


def test_hostile_memory_bomb_is_contained():
  prog = ("chunks = []\n"
          "try:\n"
          "  for _ in range(64):\n"
          "    chunks.append(bytearray(64 * 2**20))\n"
          "  print('PWNED')\n"
          "except MemoryError:\n"
          "  print('contained')\n")
  lim = sandbox.SandboxLimits(memory_mb=256)
  res, dt = _timed(code.run_stdio, prog, PWNED, 10.0, limits=lim)
  assert res == [False] and dt < 10.0
  # It ran and was contained (MemoryError), not killed; a program within the limit passes.
  assert code.run_stdio(prog, [{"input": "", "output": "contained"}], 10.0, limits=lim) == [True]
  within = "b = bytearray(64 * 2**20)\nprint('PWNED')\n"
  assert code.run_stdio(within, PWNED, 10.0, limits=lim) == [True]


def test_hostile_infinite_loop_is_killed_at_the_wall_clock_bound():
  res, dt = _timed(code.run_stdio, "while True:\n  pass\n", PWNED * 3, 1.0)
  assert res == [False, False, False]
  assert dt < 8.0  # the later cases are skipped after the first timeout
  assert code.run_stdio(CORRECT, PWNED * 3, 1.0) == [True, True, True]


def test_hostile_sleeper_killed_by_wall_clock_not_cpu():
  res, dt = _timed(code.run_stdio, "import time\ntime.sleep(60)\nprint('PWNED')\n", PWNED, 1.0)
  assert res == [False] and dt < 8.0
  assert code.run_stdio("import time\ntime.sleep(0.1)\nprint('PWNED')\n", PWNED, 1.0) == [True]


def test_hostile_writes_outside_the_sandbox(tmp_path):
  token = uuid.uuid4().hex
  repo_root = pathlib.Path(__file__).resolve().parents[2]
  targets = [tmp_path / f"escape_{token}", pathlib.Path("/tmp") / f"disa_escape_{token}",
             pathlib.Path("/var/tmp") / f"disa_escape_{token}",
             pathlib.Path("/dev/shm") / f"disa_escape_{token}", repo_root / f"escape_{token}"]
  prog = ("import os\n"
          f"targets = {[str(t) for t in targets]!r}\n"
          "targets.append(os.path.expanduser('~/../escape_" + token + "'))\n"
          "ok = 0\n"
          "for t in targets:\n"
          "  try:\n"
          "    open(t, 'w').write('x')\n"
          "    ok += 1\n"
          "  except OSError:\n"
          "    pass\n"
          "open('inside.txt', 'w').write('fine')\n"  # writing inside works
          "print('PWNED' if ok else open('inside.txt').read())\n")
  try:
    assert code.run_stdio(prog, PWNED, 10.0) == [False]
    assert code.run_stdio(prog, [{"input": "", "output": "fine"}], 10.0) == [True]
    for t in targets:
      assert not t.exists(), t
  finally:
    for t in targets:
      if t.exists():
        t.unlink()


def test_hostile_reads_the_graders_environment(monkeypatch):
  secret = "disa-secret-" + uuid.uuid4().hex
  monkeypatch.setenv("DISA_TEST_SECRET", secret)
  prog = ("import os\n"
          f"secret = {secret!r}\n"
          "found = secret in repr(dict(os.environ))\n"
          "for pid in os.listdir('/proc'):\n"
          "  if pid.isdigit():\n"
          "    try:\n"
          "      found |= secret.encode() in open(f'/proc/{pid}/environ', 'rb').read()\n"
          "    except OSError:\n"
          "      pass\n"
          f"for pid in ({os.getpid()}, {os.getppid()}):\n"
          "  try:\n"
          "    found |= secret.encode() in open(f'/proc/{pid}/environ', 'rb').read()\n"
          "  except OSError:\n"
          "    pass\n"
          "print('PWNED' if found else 'contained')\n")
  assert code.run_stdio(prog, PWNED, 10.0) == [False]
  assert code.run_stdio(prog, [{"input": "", "output": "contained"}], 10.0) == [True]


def test_hostile_reads_the_repository_and_datasets():
  if sandbox.sandbox_mode() == "none":
    pytest.skip("the 'none' fallback leaves world-readable files readable (documented)")
  here = pathlib.Path(__file__).resolve()
  fixture = here.parents[1] / "fixtures" / "benchmarks" / "README.md"
  prog = ("paths = " + repr([str(here), str(fixture), os.path.expanduser("~")]) + "\n"
          "import os\n"
          "seen = []\n"
          "for p in paths:\n"
          "  try:\n"
          "    seen.append(bool(os.listdir(p)) if os.path.isdir(p) else bool(open(p).read()))\n"
          "  except OSError:\n"
          "    seen.append(False)\n"
          "print('PWNED' if any(seen) else 'contained')\n")
  assert code.run_stdio(prog, PWNED, 10.0) == [False]
  assert code.run_stdio(prog, [{"input": "", "output": "contained"}], 10.0) == [True]


def test_hostile_signals_the_parent_and_the_grader():
  if os.geteuid() != 0:
    pytest.skip("kill(-1) is only safe here when the sandbox runs as a throw-away uid")
  prog = ("import os, signal\n"
          "hits = 0\n"
          f"for pid in (os.getppid(), {os.getpid()}, {os.getppid()}, 1):\n"
          "  try:\n"
          "    os.kill(pid, signal.SIGKILL)\n"
          "    hits += 1\n"
          "  except OSError:\n"
          "    pass\n"
          "try:\n"
          "  os.kill(-1, signal.SIGKILL)\n"  # every process it may signal (but itself)
          "except OSError:\n"
          "  pass\n"
          "print('PWNED' if hits else 'contained', flush=True)\n")
  res, dt = _timed(code.run_stdio, prog, PWNED, 5.0)
  assert res == [False] and dt < 10.0
  assert code.run_stdio(prog, [{"input": "", "output": "contained"}], 5.0) == [True]
  # The supervisor survived and ran the second case; the grader (this process) is alive.
  res = sandbox.run_cases({"p.py": prog}, "p.py", [None, None], timeout_s=5.0)
  assert [(r.ok, r.stdout) for r in res] == [(True, b"contained\n")] * 2


def test_hostile_closes_stdout():
  prog = "import os, sys\nos.close(1)\nos.close(2)\nprint('PWNED')\n"
  res, dt = _timed(code.run_stdio, prog, PWNED, 5.0)
  assert res == [False] and dt < 5.0
  assert code.run_stdio("import os\nos.close(2)\n" + CORRECT, PWNED, 5.0) == [True]


def test_hostile_floods_output():
  prog = ("import sys\n"
          "while True:\n"
          "  sys.stdout.write('A' * 65536)\n"
          "  sys.stderr.write('B' * 65536)\n")
  lim = sandbox.SandboxLimits(fsize_mb=1)
  t0 = time.perf_counter()
  res = sandbox.run_cases({"p.py": prog}, "p.py", [None], timeout_s=10.0, limits=lim)
  dt = time.perf_counter() - t0
  # Stopped by RLIMIT_FSIZE, not by the clock (Python ignores SIGXFSZ and fails with EFBIG).
  assert not res[0].ok and not res[0].timed_out
  assert res[0].signal == signal.SIGXFSZ or res[0].exit_code != 0
  assert len(res[0].stdout) <= 1 << 20 and len(res[0].stderr) <= 1 << 20
  assert dt < 8.0
  assert code.run_stdio(prog, [{"input": "", "output": "A"}], 10.0, limits=lim) == [False]
  below = "import sys\nsys.stdout.write('A' * 65536)\n"  # 64 KiB: within the 1 MiB limit
  assert code.run_stdio(below, [{"input": "", "output": "A" * 65536}], 10.0, limits=lim) == [True]


def test_daemonised_children_do_not_survive_their_case():
  prog = ("import os, time\n"
          "if os.fork() == 0:\n"
          "  os.setsid()\n"
          "  if os.fork() == 0:\n"
          "    time.sleep(60)\n"
          "  os._exit(0)\n"
          "print(os.getuid(), 'done')\n")
  res = sandbox.run_cases({"p.py": prog}, "p.py", [None], timeout_s=5.0)
  assert res[0].ok and res[0].stdout.split()[1] == b"done"
  assert _no_leftovers(res[0].stdout)


_NONE = sandbox.SandboxConfig(mode="none", allow_none=True)


def test_fallback_mode_none_still_applies_limits():
  res = sandbox.run_cases({"p.py": "print(input()[::-1])"}, "p.py", [b"abc"], timeout_s=10.0,
                          config=_NONE)
  assert res[0].ok and res[0].stdout == b"cba\n"
  res, dt = _timed(sandbox.run_cases, {"p.py": "while True: pass"}, "p.py", [None],
                   timeout_s=1.0, config=_NONE)
  assert res[0].timed_out and dt < 8.0
  if os.geteuid() == 0:
    prog = ("import os, time\nn = 0\nfor _ in range(100):\n  try:\n    pid = os.fork()\n"
            "  except OSError:\n    continue\n  if pid == 0:\n    time.sleep(30)\n    os._exit(0)\n"
            "  n += 1\nprint(os.getuid(), n, flush=True)\n")
    res = sandbox.run_cases({"p.py": prog}, "p.py", [None], timeout_s=3.0, config=_NONE,
                            limits=sandbox.SandboxLimits(nproc=8))
    assert int(res[0].stdout.split()[1]) < 8
    assert _no_leftovers(res[0].stdout)


def test_userns_mode_for_an_unprivileged_grader(tmp_path):
  """The non-root path: `unshare --user --map-root-user` namespaces, run by uid 65534."""
  import shutil
  import subprocess
  import sys
  sys_python = "/usr/bin/python3"
  if os.geteuid() != 0 or not shutil.which("setpriv") or not os.path.exists(sys_python):
    pytest.skip("needs root (to drop to uid 65534), setpriv and a system python3")
  ver = subprocess.run([sys_python, "-c", "import sys; print(sys.version_info[:2])"],
                       capture_output=True, text=True).stdout.strip()
  if ver != str(sys.version_info[:2]):
    pytest.skip(f"system python {ver} differs from {sys.version_info[:2]}")
  repo = pathlib.Path(__file__).resolve().parents[2]
  site = [p for p in sys.path if p.endswith("site-packages")]
  os.chmod(tmp_path, 0o777)
  script = (
    "import sys\n"
    "from disa_jax.rewards import sandbox\n"
    "try:\n"
    "  assert sandbox.sandbox_mode() == 'userns'\n"
    "except sandbox.SandboxUnavailableError:\n"
    "  print('userns-unavailable')\n"
    "  sys.exit(0)\n"
    "prog = ('import socket\\ntry:\\n'\n"
    "        '  socket.create_connection((\"127.0.0.1\", 9), timeout=1)\\n'\n"
    "        '  print(\"net\")\\nexcept OSError:\\n  print(\"nonet\")\\n')\n"
    "r = sandbox.run_cases({'p.py': prog}, 'p.py', [None], timeout_s=10)\n"
    "assert r[0].ok and r[0].stdout == b'nonet\\n', r\n"
    "r = sandbox.run_cases({'p.py': 'while True: pass'}, 'p.py', [None], timeout_s=1)\n"
    "assert r[0].timed_out, r\n"
    "print('userns-ok')\n")
  env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path),
         "PYTHONPATH": ":".join([str(repo)] + site)}
  out = subprocess.run(["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups",
                        "--inh-caps=-all", "--bounding-set=-all", sys_python, "-c", script],
                       env=env, capture_output=True, text=True, timeout=120)
  if "userns-unavailable" in out.stdout:
    pytest.skip("user namespaces are not allowed for unprivileged users here")
  assert out.stdout.strip().endswith("userns-ok"), out.stderr[-2000:]


def test_refuses_to_run_without_isolation(monkeypatch, tmp_path):
  """Issue 24, finding 2: no namespaces -> a named error, or mode none with one warning."""
  monkeypatch.setattr(sandbox, "_PROBED", {})
  monkeypatch.setattr(sandbox, "_WARNED_NONE", False)
  monkeypatch.setenv("PATH", str(tmp_path))  # no `unshare`: no namespace mode works
  monkeypatch.delenv("DISA_SANDBOX_MODE", raising=False)
  monkeypatch.delenv("DISA_SANDBOX_ALLOW_NONE", raising=False)
  prog = {"p.py": "print('ran')"}
  with pytest.raises(sandbox.SandboxUnavailableError, match=r"no `unshare`.*allow_none"):
    sandbox.run_cases(prog, "p.py", [None], timeout_s=10)
  with pytest.raises(sandbox.SandboxUnavailableError, match="allow_none is False"):
    sandbox.run_cases(prog, "p.py", [None], timeout_s=10,
                      config=sandbox.SandboxConfig(mode="none"))
  monkeypatch.setenv("DISA_SANDBOX_ALLOW_NONE", "1")
  with pytest.warns(RuntimeWarning, match="WITHOUT namespaces") as rec:
    for _ in range(3):
      res = sandbox.run_cases(prog, "p.py", [None], timeout_s=10)
      assert res[0].ok and res[0].stdout == b"ran\n"
  assert len([w for w in rec if issubclass(w.category, RuntimeWarning)]) == 1  # once per process
  monkeypatch.setenv("DISA_SANDBOX_ALLOW_NONE", "yes")
  with pytest.raises(ValueError, match="DISA_SANDBOX_ALLOW_NONE must be 0 or 1, got 'yes'"):
    sandbox.run_cases(prog, "p.py", [None], timeout_s=10)
  with pytest.raises(ValueError, match="SandboxConfig.work_mb"):
    sandbox.SandboxConfig(work_mb=0)
  if os.geteuid() == 0:  # as root, userns would map the program to the host's uid 0
    with pytest.raises(sandbox.SandboxUnavailableError, match="'userns' but the grader runs as"):
      sandbox.run_cases(prog, "p.py", [None], timeout_s=10,
                        config=sandbox.SandboxConfig(mode="userns"))


def test_waits_without_pidfd(monkeypatch):
  """The fallbacks for kernels without pidfd_open: the grader's wait and the supervisor's wait."""
  import subprocess
  from disa_jax.rewards import _sandbox_boot as boot

  def no_pidfd(pid):
    raise OSError(38, "pidfd_open not implemented")

  monkeypatch.setattr(os, "pidfd_open", no_pidfd)
  res = sandbox.run_cases({"p.py": "print(7)"}, "p.py", [None], timeout_s=10)
  assert res[0].ok and res[0].stdout == b"7\n"
  fast = subprocess.Popen(["sleep", "0.1"])
  assert boot._wait_exit(fast.pid, 10.0)  # pylint: disable=protected-access
  assert fast.wait() == 0  # WNOWAIT left it to be reaped here
  slow = subprocess.Popen(["sleep", "10"])
  t0 = time.perf_counter()
  assert not boot._wait_exit(slow.pid, 0.3)  # pylint: disable=protected-access
  assert time.perf_counter() - t0 < 2.0
  slow.kill()
  slow.wait()


_REPO = pathlib.Path(__file__).resolve().parents[2]
_BATTERY = pathlib.Path(__file__).resolve().parent / "hostile_battery.py"
_SYS_PYTHON = "/usr/bin/python3"
_NOBODY = ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", "--inh-caps=-all",
           "--bounding-set=-all"]
_NS_FLAGS = ["--mount", "--net", "--pid", "--fork", "--mount-proc"]


def _kernel_allows(cmd: list[str]) -> str | None:
  """None when `cmd ... true` runs; otherwise the reason (its stderr)."""
  res = subprocess.run(cmd + ["true"], capture_output=True, text=True, timeout=30)
  return None if res.returncode == 0 else (res.stderr.strip() or f"exit {res.returncode}")


def _battery_runner(mode: str) -> tuple[list[str], dict[str, str]]:
  """The command (and PYTHONPATH) running the battery in `mode`; skips, naming why, if it can't.

  `ns` runs as root; `userns` as uid 65534 (dropped with setpriv when the tests run as root, as
  the grader of an unprivileged job would be), under the system python3 of the same version.
  """
  if shutil.which("unshare") is None:
    pytest.skip("no unshare executable")
  if mode == "ns":
    if os.geteuid() != 0:
      pytest.skip("mode ns needs root")
    why = _kernel_allows(["unshare"] + _NS_FLAGS)
    if why:
      pytest.skip(f"the kernel refuses `unshare -m -n -p` as root: {why}")
    return [sys.executable], {"PYTHONPATH": str(_REPO)}
  prefix: list[str] = []
  python = sys.executable
  site = [p for p in sys.path if p.endswith("site-packages")]
  if os.geteuid() == 0:
    if not shutil.which("setpriv") or not os.path.exists(_SYS_PYTHON):
      pytest.skip("userns as a non-root user needs setpriv and /usr/bin/python3 to drop to 65534")
    ver = subprocess.run([_SYS_PYTHON, "-c", "import sys; print(sys.version_info[:2])"],
                         capture_output=True, text=True).stdout.strip()
    if ver != str(sys.version_info[:2]):
      pytest.skip(f"system python {ver} differs from {sys.version_info[:2]}")
    prefix, python = _NOBODY, _SYS_PYTHON
  why = _kernel_allows(prefix + ["unshare", "--user", "--map-root-user"] + _NS_FLAGS)
  if why:
    pytest.skip(f"the kernel forbids unprivileged user namespaces here: {why}")
  return prefix + [python], {"PYTHONPATH": ":".join([str(_REPO)] + site)}


@pytest.mark.parametrize("mode", ["ns", "userns"])
def test_hostile_battery(mode):
  """Issue 24, findings 1 and 3: every attack of `hostile_battery.py` is blocked in both modes.

  The attacks: unmount each cover (umount2 MNT_DETACH), directly and from a user + mount namespace
  of the program's own (where it holds every capability), the supervisor's /proc/1/cwd and
  /proc/1/environ, read a host file in /tmp, in the repository and (as root) in a new top-level
  directory (directly, via /proc/1/cwd and /proc/1/root), write outside the work dir, fill the work dir past its 16 MiB cap, a fork bomb,
  a loopback connection, the program's own uid / capabilities / no_new_privs, the grader's
  processes in /proc, and signals to the supervisor (the next case must still run).
  """
  cmd, env = _battery_runner(mode)
  token = uuid.uuid4().hex
  host_files = [pathlib.Path("/tmp") / f"disa_hostile_{token}", _REPO / f"disa_hostile_{token}"]
  top = pathlib.Path(f"/disa_hostile_{token}")  # a data directory of a name no list knows
  if os.geteuid() == 0:
    top.mkdir(mode=0o755)
    host_files.append(top / "expected_outputs.txt")
  outside = [pathlib.Path(d) / f"disa_hostile_w_{token}"
             for d in ("/tmp", "/var/tmp", "/dev/shm", str(_REPO))]
  spec = {"secret": token, "host_files": [str(p) for p in host_files],
          "outside": [str(p) for p in outside], "port": testing.free_port(), "work_mb": 16, "nproc": 16}
  try:
    for p in host_files:
      p.write_text(f"expected outputs {token}\n")
      p.chmod(0o644)
    out = subprocess.run(cmd + [str(_BATTERY), json.dumps(spec)], capture_output=True, text=True,
                         timeout=240, env={"PATH": "/usr/bin:/bin", "DISA_SANDBOX_MODE": mode,
                                           "DISA_SANDBOX_WORK_MB": "16", **env})
    assert out.returncode == 0, out.stderr[-3000:]
    table = json.loads(out.stdout.strip().splitlines()[-1])
    written = [str(p) for p in outside if p.exists()]
  finally:
    for p in host_files + outside:
      if p.exists():
        p.unlink()
    if top.exists():
      top.rmdir()
  print(f"\nhostile battery, mode {mode}:")
  for name, row in table.items():
    print(f"  {name:16s} {'ESCAPED' if row['escaped'] else 'blocked'}  {row['detail'][:150]}")
  assert sorted(table) == sorted(["control", "umount_covers", "unshare_then_umount",
                                  "proc1_cwd", "proc1_environ",
                                  "read_host_files", "write_outside", "disk_fill", "fork_bomb",
                                  "socket_loopback", "privileges", "proc_host_processes",
                                  "signal_supervisor"])
  assert {k: v for k, v in table.items() if v["escaped"] is not False} == {}
  assert written == []
