"""Sandbox for untrusted programs: namespaces, an unprivileged uid, rlimits and wall-clock kills.

`run_cases(files, script, stdins, timeout_s=..., limits=..., config=...)` runs the Python script
`script` (with the grader's interpreter version, standard library only) from a private directory
holding `files`, once per stdin, and returns each run's exit status, whether it timed out,
and its (size-capped) stdout/stderr. One sandbox (one supervisor process) serves one candidate; its
cases run one after another, each in its own session.

Isolation modes (`SandboxConfig.mode`; `auto` probes once per process for the namespace mode that
fits the grader's uid):

- `ns` (running as root): `unshare --mount --net --pid --fork --kill-child --mount-proc`; the
  program runs as a fresh unprivileged uid/gid (random in [10^6, 2*10^6), so RLIMIT_NPROC counts
  only this sandbox's processes even though the grader is root).
- `userns` (not root: refused as root; user namespaces allowed): the same namespaces inside
  `unshare --user --map-root-user`; each case then enters a second user + mount namespace nested in
  it, where it is uid 1000 (the only mapped uid), so every mount of the sandbox is a locked mount
  it cannot unmount.

In both namespace modes the program has no network (an empty network namespace), a /proc of its own
PID namespace (where the supervisor is PID 1, not dumpable, so its /proc/1/{cwd,environ} are
closed), no capabilities (effective, permitted and bounding sets empty) and `no_new_privs`; its
cwd and HOME are a private tmpfs of `SandboxConfig.work_mb` MiB (all its files together);
world-writable directories are covered by read-only tmpfs, and every top-level directory but the
system ones (so /root, /home, /work, /mnt, /opt, cluster file systems such as /lustre, the
grader's cwd and this repository: also the datasets with the expected outputs) is hidden under an
empty tmpfs. System directories (/usr, /lib, /etc, /var, ...) stay readable. When the supervisor exits or is killed every process of the sandbox dies with it.
The case child checks its own capabilities, uid and no_new_privs before exec and refuses to run the
program (exit 126) if any is left.

- `none`: rlimits, a new session, a private directory on the host's disk, a scrubbed environment,
  no capabilities and no_new_privs only (as root, also a fresh uid); **the network is reachable**,
  world-readable files (datasets with the expected outputs included) are readable and the work
  directory has no size cap. Never chosen by itself: without a working namespace mode the sandbox
  raises `SandboxUnavailableError`, unless `SandboxConfig.allow_none` is set, and then warns once
  per process.

The default config comes from the environment (`default_config`): `DISA_SANDBOX_MODE`
(auto | ns | userns | none), `DISA_SANDBOX_ALLOW_NONE` (0 | 1), `DISA_SANDBOX_WORK_MB`.

In every mode: RLIMIT_CPU, RLIMIT_AS, RLIMIT_FSIZE (caps stdout/stderr too: they are files),
RLIMIT_NPROC and RLIMIT_NOFILE; the environment holds only PATH, HOME, TMPDIR, locale and thread
caps (plus LD_LIBRARY_PATH of the bind-mounted interpreter); the wall-clock timeout kills every
process of the case, and the grader additionally kills the supervisor's whole process group if the
supervisor itself overruns.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import warnings
from typing import Mapping, Sequence

__all__ = ["SandboxLimits", "SandboxConfig", "SandboxUnavailableError", "CaseResult", "run_cases",
           "sandbox_mode", "default_config", "MODES"]

MODES = ("ns", "userns", "none")
_USERNS_UID = 1000  # the program's uid in the nested user namespace of userns mode
_BOOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sandbox_boot.py")
_COVER = ("/tmp", "/var/tmp", "/run/lock", "/dev/shm")
# The system directories the program may see. Every other top-level directory (user data: code,
# datasets with the expected outputs, credentials, cluster file systems) is hidden from it in the
# namespace modes, together with the grader's cwd and this repository.
_SYSTEM = ("/", "/usr", "/lib", "/lib32", "/lib64", "/libx32", "/bin", "/sbin", "/etc", "/dev",
           "/proc", "/sys", "/tmp", "/var", "/run", "/nix", "/gnu")
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_HOME_NS = "/tmp/home"
_NS_PREFIX = ("unshare", "--mount", "--net", "--pid", "--fork", "--kill-child", "--mount-proc")
_USERNS_PREFIX = ("unshare", "--user", "--map-root-user", "--mount", "--net", "--pid", "--fork",
                  "--kill-child", "--mount-proc")


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
  """Resource limits of one sandboxed process (each case's process and its children).

  Attributes:
    cpu_s: RLIMIT_CPU in seconds, per process.
    memory_mb: RLIMIT_AS in MiB, per process.
    fsize_mb: RLIMIT_FSIZE in MiB: the largest file, stdout and stderr included, it may write.
    nproc: RLIMIT_NPROC: processes of the sandbox uid (modes `ns` and root `none`).
    nofile: RLIMIT_NOFILE.
    output_cap_bytes: how much of stdout/stderr the grader reads back.
  """
  cpu_s: int = 10
  memory_mb: int = 2048
  fsize_mb: int = 16
  nproc: int = 32
  nofile: int = 64
  output_cap_bytes: int = 16 * 1024 * 1024

  def __post_init__(self):
    for f in dataclasses.fields(self):
      v = getattr(self, f.name)
      if not isinstance(v, int) or v < 1:
        raise ValueError(f"SandboxLimits.{f.name} must be a positive int, got {v!r}")

  def rlimits(self) -> dict[str, int]:
    return {
      "RLIMIT_CPU": self.cpu_s,
      "RLIMIT_AS": self.memory_mb * 1024 * 1024,
      "RLIMIT_FSIZE": self.fsize_mb * 1024 * 1024,
      "RLIMIT_NPROC": self.nproc,
      "RLIMIT_NOFILE": self.nofile,
      "RLIMIT_CORE": 0,
    }


class SandboxUnavailableError(RuntimeError):
  """No isolating mode works here and `SandboxConfig.allow_none` is not set."""


@dataclasses.dataclass(frozen=True)
class SandboxConfig:
  """How the sandbox isolates programs.

  Attributes:
    mode: `auto` (the namespace mode for the grader's uid: `ns` as root, `userns` otherwise),
      `ns`, `userns`, or `none` (no isolation; needs `allow_none`).
    allow_none: run without namespaces when no namespace mode works (or when `mode` is `none`):
      untrusted code then reaches the network and every file the grader's user can read.
    work_mb: size cap in MiB of the program's work directory (a tmpfs) in the namespace modes.
  """
  mode: str = "auto"
  allow_none: bool = False
  work_mb: int = 64

  def __post_init__(self):
    if self.mode not in ("auto",) + MODES:
      raise ValueError(f"SandboxConfig.mode must be one of {('auto',) + MODES}, got {self.mode!r}")
    if not isinstance(self.allow_none, bool):
      raise ValueError(f"SandboxConfig.allow_none must be a bool, got {self.allow_none!r}")
    if isinstance(self.work_mb, bool) or not isinstance(self.work_mb, int) or self.work_mb < 1:
      raise ValueError(f"SandboxConfig.work_mb must be a positive int, got {self.work_mb!r}")


def default_config() -> SandboxConfig:
  """The config from `DISA_SANDBOX_MODE`, `DISA_SANDBOX_ALLOW_NONE` and `DISA_SANDBOX_WORK_MB`.

  Raises:
    ValueError: naming the variable and its value when one is malformed.
  """
  env = os.environ
  allow = env.get("DISA_SANDBOX_ALLOW_NONE", "0")
  if allow not in ("0", "1"):
    raise ValueError(f"DISA_SANDBOX_ALLOW_NONE must be 0 or 1, got {allow!r}")
  work = env.get("DISA_SANDBOX_WORK_MB", str(SandboxConfig.work_mb))
  if not work.isdigit():
    raise ValueError(f"DISA_SANDBOX_WORK_MB must be a positive integer, got {work!r}")
  try:
    return SandboxConfig(mode=env.get("DISA_SANDBOX_MODE", "auto") or "auto",
                         allow_none=allow == "1", work_mb=int(work))
  except ValueError as e:
    raise ValueError(f"{e} (from the DISA_SANDBOX_* environment variables)") from None


@dataclasses.dataclass
class CaseResult:
  """Outcome of one case.

  Attributes:
    exit_code: the exit status, or None when killed by a signal / not run.
    signal: the killing signal number, or None.
    timed_out: the wall-clock bound expired.
    skipped: not run (an earlier case timed out and `stop_on_timeout` was set, or the supervisor
      failed).
    wall_s: wall-clock seconds of the case.
    stdout: captured stdout (at most `output_cap_bytes`).
    stderr: captured stderr (at most `output_cap_bytes`).
  """
  exit_code: int | None
  signal: int | None
  timed_out: bool
  skipped: bool
  wall_s: float
  stdout: bytes
  stderr: bytes

  @property
  def ok(self) -> bool:
    """Exited normally with status 0 within its bound."""
    return self.exit_code == 0 and not self.timed_out and not self.skipped


_PROBED: dict[str, str | None] = {}  # namespace mode -> None (works) or why it does not
_MODE_LOCK = threading.Lock()
_WARNED_NONE = False


_PYTHON_NS = "/tmp/python"
# The program runs as `python -I -S -c _LAUNCH <script>`: no `site` (its .pth hooks cost ~40 ms per
# start on some machines and only matter for third-party packages, which the sandboxed interpreter
# does not promise), with the `exit`/`quit` builtins that `site` would add, and the script executed
# as `__main__` (plain `exec`: importing `runpy` alone costs ~25 ms).
_LAUNCH = ("import sys, builtins, _sitebuiltins as s\n"
           "builtins.exit = s.Quitter('exit', 'Ctrl-D (i.e. EOF)')\n"
           "builtins.quit = s.Quitter('quit', 'Ctrl-D (i.e. EOF)')\n"
           "sys.argv = sys.argv[1:]\n"
           "with open(sys.argv[0], 'rb') as f:\n"
           "  code = compile(f.read(), sys.argv[0], 'exec')\n"
           "g = {'__name__': '__main__', '__file__': sys.argv[0], '__builtins__': builtins}\n"
           "del f, s\n"
           "exec(code, g)\n")


def _interpreter(mode: str, setuid: bool) -> tuple[str, list[str] | None]:
  """The interpreter the program runs with, and the bind mount that exposes it.

  In the namespace modes the grader's own base interpreter (same version) is bind-mounted read-only
  at /tmp/python, since its install tree may sit in a directory the sandbox uid cannot traverse
  (e.g. /root). Without namespaces, a root grader that drops to a fresh uid uses /usr/bin/python3
  when it exists (the only interpreter such a uid can be expected to reach); otherwise
  `sys.executable`.

  Returns:
    (argv[0], [bind source, bind target] or None).
  """
  if mode in ("ns", "userns"):
    base = os.path.realpath(sys.base_prefix)
    exe = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
    if exe.startswith(base + os.sep):
      return _PYTHON_NS + exe[len(base):], [base, _PYTHON_NS]
    return exe, None
  if setuid and os.path.exists("/usr/bin/python3"):
    return "/usr/bin/python3", None
  return sys.executable, None


def _python() -> str:
  return sys.executable


def _hidden_dirs() -> list[str]:
  """Every top-level directory but `_SYSTEM`, plus the grader's cwd and the repository when they
  lie inside a system directory that can be hidden (not /usr, /lib, /etc, ...)."""
  tops = [os.path.join("/", d) for d in sorted(os.listdir("/"))]
  out: list[str] = []
  for d in [t for t in tops if os.path.isdir(t) and not os.path.islink(t)] + [os.getcwd(), _REPO]:
    d = os.path.realpath(d)
    if d in _SYSTEM or any(d.startswith(h + "/") for h in out) or d in out:
      continue
    if d.startswith(("/usr/", "/lib/", "/etc/", "/proc/", "/sys/", "/dev/")):
      continue
    out.append(d)
  return out


def _scrubbed_env(home: str) -> dict[str, str]:
  return {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "HOME": home,
    "TMPDIR": home,
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    "PYTHONIOENCODING": "utf-8",
    "PYTHONDONTWRITEBYTECODE": "1",
    "PYTHONHASHSEED": "0",
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
  }


def _write_work_files(stage: str, mode: str, files: Mapping[str, str | bytes],
                      stdins: Sequence[bytes | None], uid: int | None) -> tuple[str, str]:
  """Creates the stage's private work directory (the program's files) and io directory (stdins).

  Args:
    stage: the stage directory (fresh, from `tempfile.mkdtemp`).
    mode: the isolation mode.
    files: relative file name -> content, written under ``<stage>/work``.
    stdins: one entry per case; each non-None one is written to ``<stage>/io/in_<i>``.
    uid: the sandbox uid that gets to own the work directory (mode `none` only: in the namespace
      modes the supervisor copies the files into the work tmpfs), or None.

  Returns:
    (work directory, io directory).

  Raises:
    ValueError: on an absolute file name, one containing '..', or an empty one.
  """
  # Without namespaces the work directory is reached through the stage path itself, so the stage
  # must be traversable (not listable); io/ stays root-only.
  os.chmod(stage, 0o700 if mode in ("ns", "userns") else 0o711)
  work = os.path.join(stage, "work")
  io_dir = os.path.join(stage, "io")
  os.mkdir(work, 0o700)
  os.mkdir(io_dir, 0o700)
  for name, content in files.items():
    if os.path.isabs(name) or ".." in name.split("/") or not name:
      raise ValueError(f"files: bad file name {name!r} (must be relative, without '..')")
    path = os.path.join(work, name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
      f.write(content.encode() if isinstance(content, str) else content)
  if uid is not None:
    for root, dirs, fnames in os.walk(work):
      for n in [root] + [os.path.join(root, d) for d in dirs] + [
          os.path.join(root, fn) for fn in fnames]:
        os.chown(n, uid, uid)
  for i, data in enumerate(stdins):
    if data is not None:
      with open(os.path.join(io_dir, f"in_{i}"), "wb") as f:
        f.write(data)
  return work, io_dir


def _boot_config(mode: str, work: str, uid: int | None, script: str, num_cases: int,
                 timeout_s: float, limits: SandboxLimits, stop_on_timeout: bool,
                 work_mb: int) -> dict:
  """The supervisor's ``config.json`` (read by `_sandbox_boot.py`).

  Args:
    mode: the isolation mode.
    work: the private work directory (HOME without namespaces).
    uid: the sandbox uid and gid, or None to keep the grader's.
    script: the file to run, relative to the work directory.
    num_cases: number of cases (stdins).
    timeout_s: wall-clock bound of each case.
    limits: the rlimits.
    stop_on_timeout: skip the remaining cases after a timeout.
    work_mb: size of the work tmpfs (namespace modes).

  Returns:
    The JSON-ready supervisor config: mounts, work tmpfs size, the nested-namespace uid, hidden
    and covered directories, uid, rlimits, the program's argv and environment, and the case
    settings.
  """
  home = _HOME_NS if mode in ("ns", "userns") else work
  python, python_bind = _interpreter(mode, uid is not None)
  env = _scrubbed_env(home)
  if python_bind:  # the interpreter's RUNPATH may point into a hidden directory
    env["LD_LIBRARY_PATH"] = python_bind[1] + "/lib"
  return {
    "mounts": mode in ("ns", "userns"),
    "pid_namespace": mode in ("ns", "userns"),
    "cover": [d for d in _COVER if os.path.isdir(d) and not os.path.islink(d)],
    "home": home,
    "uid": uid,
    "gid": uid,
    "userns_uid": _USERNS_UID if mode == "userns" else None,
    "work_mb": work_mb,
    "rlimits": limits.rlimits(),
    "python_bind": python_bind,
    "hide": _hidden_dirs() if mode in ("ns", "userns") else [],
    "argv": [python, "-I", "-S", "-c", _LAUNCH, script],
    "env": env,
    "num_cases": num_cases,
    "timeout_s": float(timeout_s),
    "stop_on_timeout": bool(stop_on_timeout),
  }


def _run_supervisor(mode: str, stage: str, num_cases: int, timeout_s: float) -> str:
  """Runs the supervisor (`_sandbox_boot.py`) in the stage and waits for it.

  The supervisor's whole process group is killed if it overruns the bound of all its cases.

  Args:
    mode: the isolation mode (picks the `unshare` prefix).
    stage: the stage directory (its cwd; holds ``io/config.json``).
    num_cases: number of cases (sizes the overall bound).
    timeout_s: wall-clock bound of each case.

  Returns:
    The path of the file holding the supervisor's own stdout and stderr.
  """
  prefix = {"ns": _NS_PREFIX, "userns": _USERNS_PREFIX, "none": ()}[mode]
  cmd = list(prefix) + [_python(), "-I", "-S", _BOOT]
  boot_err = os.path.join(stage, "boot_err")
  with open(boot_err, "wb") as err_f:
    proc = subprocess.Popen(cmd, cwd=stage, stdin=subprocess.DEVNULL, stdout=err_f,
                            stderr=err_f, start_new_session=True,
                            env={"PATH": "/usr/local/bin:/usr/bin:/bin"})
    overall = num_cases * (float(timeout_s) + 2.0) + 20.0
    if not _wait_pid(proc, overall):
      try:
        os.killpg(proc.pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
    proc.wait()
  return boot_err


def _case_results(io_dir: str, boot_err: str, num_cases: int, output_cap: int) -> list[CaseResult]:
  """Reads the supervisor's ``result.json`` and each case's capped stdout / stderr.

  Args:
    io_dir: the stage's io directory.
    boot_err: the supervisor's own output file (reported when it wrote no result).
    num_cases: number of cases.
    output_cap: bytes of stdout / stderr read back per case.

  Returns:
    One `CaseResult` per case; all skipped, with the supervisor's output as stderr, when the
    supervisor failed.
  """
  result_path = os.path.join(io_dir, "result.json")
  if not os.path.exists(result_path):
    with open(boot_err, "rb") as f:
      msg = f.read(4000).decode(errors="replace")
    return [CaseResult(None, None, False, True, 0.0, b"", msg.encode()) for _ in range(num_cases)]
  with open(result_path) as f:
    statuses = json.load(f)
  out = []
  for i, st in enumerate(statuses):
    out.append(CaseResult(
      exit_code=st["exit"], signal=st["signal"], timed_out=st["timed_out"],
      skipped=st["skipped"], wall_s=st["wall_s"],
      stdout=_read_capped(os.path.join(io_dir, f"out_{i}"), output_cap),
      stderr=_read_capped(os.path.join(io_dir, f"err_{i}"), output_cap)))
  return out


def _run(mode: str, files: Mapping[str, str | bytes], script: str, stdins: Sequence[bytes | None],
         timeout_s: float, limits: SandboxLimits, stop_on_timeout: bool,
         work_mb: int) -> list[CaseResult]:
  """Runs the cases in the given mode (see `run_cases`)."""
  is_root = os.geteuid() == 0
  uid = random.randrange(1_000_000, 2_000_000) if (is_root and mode in ("ns", "none")) else None
  stage = tempfile.mkdtemp(prefix="disa_sbx_")
  try:
    work, io_dir = _write_work_files(stage, mode, files, stdins, uid if mode == "none" else None)
    cfg = _boot_config(mode, work, uid, script, len(stdins), timeout_s, limits, stop_on_timeout,
                       work_mb)
    with open(os.path.join(io_dir, "config.json"), "w") as f:
      json.dump(cfg, f)
    boot_err = _run_supervisor(mode, stage, len(stdins), timeout_s)
    return _case_results(io_dir, boot_err, len(stdins), limits.output_cap_bytes)
  finally:
    shutil.rmtree(stage, ignore_errors=True)


def _wait_pid(proc: subprocess.Popen, timeout_s: float) -> bool:
  """Waits up to `timeout_s` for `proc`; True if it exited.

  Blocks on a pidfd where the kernel has them (`Popen.wait(timeout)` polls with sleeps of up to
  50 ms, which would add that much latency to every sandbox run).
  """
  try:
    pidfd = os.pidfd_open(proc.pid)
  except (AttributeError, OSError):
    try:
      proc.wait(timeout=timeout_s)
      return True
    except subprocess.TimeoutExpired:
      return False
  try:
    done, _, _ = select.select([pidfd], [], [], timeout_s)
  finally:
    os.close(pidfd)
  return bool(done)


def _read_capped(path: str, cap: int) -> bytes:
  try:
    with open(path, "rb") as f:
      return f.read(cap)
  except FileNotFoundError:
    return b""


def _probe(mode: str) -> str | None:
  """None when `mode` runs a test program here; otherwise why not."""
  if shutil.which("unshare") is None:
    return "no `unshare` executable on PATH"
  probe = "import os\nprint('sandbox-ok', os.getuid())\n"
  try:
    res = _run(mode, {"probe.py": probe}, "probe.py", [None], 20.0, SandboxLimits(), False, 1)
  except OSError as e:
    return f"{type(e).__name__}: {e}"
  if res[0].ok and res[0].stdout.startswith(b"sandbox-ok"):
    return None
  detail = (res[0].stderr or res[0].stdout).decode(errors="replace").strip()[-500:]
  return f"the probe program failed (exit {res[0].exit_code}): {detail}"


def _warn_none_once() -> None:
  global _WARNED_NONE
  if not _WARNED_NONE:
    _WARNED_NONE = True
    warnings.warn("the code sandbox runs in mode 'none' (SandboxConfig.allow_none): untrusted "
                  "programs run WITHOUT namespaces; they can reach the network and read every "
                  "file the grader's user can read (datasets with the expected outputs included) "
                  "and fill its disk", RuntimeWarning, stacklevel=3)


def sandbox_mode(config: SandboxConfig | None = None) -> str:
  """The isolation mode `config` (default `default_config()`) gets here.

  The namespace mode is probed once per process (a test program must run in it).

  Raises:
    SandboxUnavailableError: when the requested or probed namespace mode does not work and
      `config.allow_none` is False (or `mode` is `none` without `allow_none`), naming why.
  """
  config = config or default_config()
  if config.mode == "none":
    if not config.allow_none:
      raise SandboxUnavailableError(
        "SandboxConfig.mode is 'none' (no isolation) but SandboxConfig.allow_none is False "
        "(DISA_SANDBOX_ALLOW_NONE=1 to accept running untrusted code unconfined)")
    _warn_none_once()
    return "none"
  mode = config.mode if config.mode != "auto" else ("ns" if os.geteuid() == 0 else "userns")
  if mode == "userns" and os.geteuid() == 0:
    raise SandboxUnavailableError(
      "SandboxConfig.mode is 'userns' but the grader runs as root: the program's uid would map to "
      "the host's uid 0 (owner of the system files); use mode 'ns' (or 'auto')")
  with _MODE_LOCK:
    if mode not in _PROBED:
      _PROBED[mode] = _probe(mode)
    why = _PROBED[mode]
  if why is None:
    return mode
  if not config.allow_none:
    raise SandboxUnavailableError(
      f"the code sandbox cannot isolate programs here: mode {mode!r} failed: {why}. Refusing to "
      f"run untrusted code without namespaces; set SandboxConfig.allow_none "
      f"(DISA_SANDBOX_ALLOW_NONE=1) to accept mode 'none'")
  _warn_none_once()
  return "none"


def run_cases(files: Mapping[str, str | bytes], script: str, stdins: Sequence[bytes | None], *,
              timeout_s: float, limits: SandboxLimits | None = None,
              stop_on_timeout: bool = True,
              config: SandboxConfig | None = None) -> list[CaseResult]:
  """Runs `python -I -S <script>` once per stdin inside one sandbox.

  Args:
    files: relative file name -> content, written into the private work directory.
    script: the file among `files` to run.
    stdins: one entry per case: bytes for stdin, or None for /dev/null.
    timeout_s: wall-clock bound of each case.
    limits: rlimits (default `SandboxLimits()`).
    stop_on_timeout: after a case times out, mark the remaining cases skipped instead of running
      them (they count as failures).
    config: isolation settings (default `default_config()`).

  Returns:
    One `CaseResult` per stdin.

  Raises:
    SandboxUnavailableError: see `sandbox_mode`.
  """
  if script not in files:
    raise ValueError(f"script {script!r} is not among files {sorted(files)}")
  if not timeout_s > 0:
    raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
  if config is not None and not isinstance(config, SandboxConfig):
    raise ValueError(f"config must be a SandboxConfig, got {type(config).__name__}")
  if not stdins:
    return []
  config = config or default_config()
  return _run(sandbox_mode(config), files, script, list(stdins), timeout_s,
              limits or SandboxLimits(), stop_on_timeout, config.work_mb)
