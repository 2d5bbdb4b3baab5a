"""Sandbox for untrusted programs: namespaces, an unprivileged uid, rlimits and wall-clock kills.

`run_cases(files, script, stdins, timeout_s=..., limits=..., config=...)` runs the Python script
`script` (with the grader's interpreter version, standard library only) from a private directory
holding `files`, once per stdin, and returns each run's exit status, whether it timed out,
and its (size-capped) stdout/stderr. One sandbox (one supervisor process) serves one candidate; its
cases run one after another, each in its own session.

Isolation modes (`SandboxConfig.mode`; `auto` probes once per process for the namespace mode that
fits the grader's uid):

- `ns` (running as root): `unshare --mount --net --ipc --pid --fork --kill-child --mount-proc`;
  the program runs as a fresh unprivileged uid/gid (drawn from [10^6, 2*10^6) and kept only when
  no passwd/group entry names it and no process has it, so RLIMIT_NPROC counts only this
  sandbox's processes even though the grader is root).
- `userns` (not root: refused as root; user namespaces allowed): the same namespaces inside
  `unshare --user --map-root-user`; each case then enters a second user + mount namespace nested in
  it, where it is uid 1000 (the only mapped uid), so every mount of the sandbox is a locked mount
  it cannot unmount.

In both namespace modes the program has no network (an empty network namespace), its own System V
IPC (an IPC namespace: the grader's shared memory is out of sight, and whatever the program makes
dies with the sandbox; capped at 16 MiB of shared memory, 16 message queues and 16 semaphore
sets where the kernel lets the namespace's root set the limits: always in `ns`, on recent kernels
in `userns`), a /proc of its own PID namespace (where the supervisor is PID 1, not dumpable, so
its /proc/1/{cwd,environ} are closed), no capabilities (effective, permitted and bounding sets
empty) and `no_new_privs`. Its root is a fresh read-only tmpfs holding only an allow-list of the
host (`_sandbox_host.root_layout`): /usr and the /bin, /lib... trees, a few /etc files the loader
and the standard library read (a fresh /etc/passwd), /dev/{null,zero,full,random,urandom}, an
empty read-only /dev/shm, its /proc, the interpreter at /tmp/python and its cwd and HOME: a private
tmpfs of `SandboxConfig.work_mb` MiB at /tmp/home (all its files together). Nothing else of the
host exists there: no /run (with its daemons' unix sockets), /var, /sys, /tmp, /home, /root,
/work, /opt, cluster file systems, the grader's cwd or this repository (the datasets with the
expected outputs). When the supervisor exits or is killed every process of the sandbox dies with
it. The case child checks its own capabilities, uid and no_new_privs before exec and refuses to
run the program (exit 126) if any is left.

- `none`: rlimits, a new session, a private directory on the host's disk, a scrubbed environment,
  no capabilities and no_new_privs only (as root, also a fresh uid, checked unused as above, whose
  System V objects are removed after each case); **the network is reachable**, world-readable
  files (datasets with the expected outputs included) and System V objects are readable and the
  work directory has no size cap. Without root the program runs as the grader's uid: it can reach
  the stage and the grader's files, and RLIMIT_NPROC counts all of that user's processes. Never
  chosen by itself: without a working namespace mode the sandbox raises `SandboxUnavailableError`,
  unless `SandboxConfig.allow_none` is set, and then warns once per process.

The default config comes from the environment (`default_config`): `DISA_SANDBOX_MODE`
(auto | ns | userns | none), `DISA_SANDBOX_ALLOW_NONE` (0 | 1), `DISA_SANDBOX_WORK_MB`.

In every mode: RLIMIT_CPU, RLIMIT_AS, RLIMIT_FSIZE (caps stdout/stderr too: they are files),
RLIMIT_NPROC and RLIMIT_NOFILE; the environment holds only PATH, HOME, TMPDIR, locale and thread
caps (plus LD_LIBRARY_PATH of the bind-mounted interpreter); the wall-clock timeout kills every
process of the case (the supervisor is a child subreaper, so `setsid` daemons are found too), and
the grader additionally kills the supervisor's whole process group if the supervisor itself
overruns. The grader reads back only regular files (no symlink, FIFO or hard link a program of
mode `none` could plant in the stage), at most `output_cap_bytes` of each.

Memory of one sandbox (no cgroup is used: see `SandboxLimits`): RLIMIT_AS caps each process at
`memory_mb` and RLIMIT_NPROC is lowered so that processes x `memory_mb` <= `total_memory_mb`; on top
of that come the work tmpfs (`work_mb`, namespace modes), System V IPC (16 MiB of shared memory
and ~1.5 MiB of message queues, namespace modes) and kernel buffers (pipes, sockets: bounded by
RLIMIT_NOFILE per process).

Stage directories (``$TMPDIR/disa_sbx_<pidns>_<pid>_<start>_*``) are named after their grader;
each grading first removes those of dead graders (a grader killed by SIGKILL leaves its stage).
"""

from __future__ import annotations

import dataclasses
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import threading
import warnings
from typing import Mapping, Sequence

from disa_jax.rewards import _sandbox_host

__all__ = ["SandboxLimits", "SandboxConfig", "SandboxUnavailableError", "CaseResult", "run_cases",
           "sandbox_mode", "default_config", "MODES"]

MODES = ("ns", "userns", "none")
_BOOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sandbox_boot.py")
_NS_PREFIX = ("unshare", "--mount", "--net", "--ipc", "--pid", "--fork", "--kill-child",
              "--mount-proc")
_USERNS_PREFIX = ("unshare", "--user", "--map-root-user", "--mount", "--net", "--ipc", "--pid",
                  "--fork", "--kill-child", "--mount-proc")


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
  """Resource limits of one sandbox (each case's process and its children).

  No cgroup bounds the sandbox as a whole (cgroup v2 with a delegated memory controller is not
  something a grader can count on); instead RLIMIT_NPROC is lowered until RLIMIT_AS x RLIMIT_NPROC
  fits `total_memory_mb` (see `effective_nproc`). RLIMIT_NPROC counts threads too.

  Attributes:
    cpu_s: RLIMIT_CPU in seconds, per process.
    memory_mb: RLIMIT_AS in MiB, per process.
    fsize_mb: RLIMIT_FSIZE in MiB: the largest file, stdout and stderr included, it may write.
    nproc: RLIMIT_NPROC at most: processes of the sandbox uid (modes `ns` and root `none`; in
      `userns` the supervisor and `unshare` take 2 of them, in non-root `none` every process of
      the grader's user counts).
    nofile: RLIMIT_NOFILE.
    output_cap_bytes: how much of stdout/stderr the grader reads back.
    total_memory_mb: the address space of all processes of the sandbox together.
  """
  cpu_s: int = 10
  memory_mb: int = 2048
  fsize_mb: int = 16
  nproc: int = 32
  nofile: int = 64
  output_cap_bytes: int = 16 * 1024 * 1024
  total_memory_mb: int = 8192

  def __post_init__(self):
    for f in dataclasses.fields(self):
      v = getattr(self, f.name)
      if not isinstance(v, int) or v < 1:
        raise ValueError(f"SandboxLimits.{f.name} must be a positive int, got {v!r}")
    if self.total_memory_mb < self.memory_mb:
      raise ValueError(f"SandboxLimits.total_memory_mb ({self.total_memory_mb}) must be at least "
                       f"memory_mb ({self.memory_mb}), the address space of one process")

  @property
  def effective_nproc(self) -> int:
    """RLIMIT_NPROC: `nproc`, lowered so that it times `memory_mb` is at most `total_memory_mb`."""
    return min(self.nproc, self.total_memory_mb // self.memory_mb)

  def rlimits(self) -> dict[str, int]:
    return {
      "RLIMIT_CPU": self.cpu_s,
      "RLIMIT_AS": self.memory_mb * 1024 * 1024,
      "RLIMIT_FSIZE": self.fsize_mb * 1024 * 1024,
      "RLIMIT_NPROC": self.effective_nproc,
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
  cmd = list(prefix) + [sys.executable, "-I", "-S", _BOOT]
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
  raw = _sandbox_host.read_regular(os.path.join(io_dir, "result.json"), 4096 + 256 * num_cases)
  try:
    statuses = json.loads(raw) if raw is not None else None
  except ValueError:
    statuses = None
  if not isinstance(statuses, list) or len(statuses) != num_cases:
    msg = (_sandbox_host.read_regular(boot_err, 4000) or b"").decode(errors="replace")
    msg = msg or f"sandbox: the supervisor wrote no valid result.json ({raw!r:.200})"
    return [CaseResult(None, None, False, True, 0.0, b"", msg.encode()) for _ in range(num_cases)]
  out = []
  for i, st in enumerate(statuses):
    out.append(CaseResult(
      exit_code=st["exit"], signal=st["signal"], timed_out=st["timed_out"],
      skipped=st["skipped"], wall_s=st["wall_s"],
      stdout=_sandbox_host.read_regular(os.path.join(io_dir, f"out_{i}"), output_cap) or b"",
      stderr=_sandbox_host.read_regular(os.path.join(io_dir, f"err_{i}"), output_cap) or b""))
  return out


def _run(mode: str, files: Mapping[str, str | bytes], script: str, stdins: Sequence[bytes | None],
         timeout_s: float, limits: SandboxLimits, stop_on_timeout: bool,
         work_mb: int) -> list[CaseResult]:
  """Runs the cases in the given mode (see `run_cases`), after removing dead graders' stages."""
  _sandbox_host.sweep_stale_stages()
  fresh_uid = os.geteuid() == 0 and mode in ("ns", "none")
  uid = _sandbox_host.acquire_uid() if fresh_uid else None
  stage = None
  try:
    stage = _sandbox_host.make_stage()
    work, io_dir = _sandbox_host.write_work_files(stage, mode, files, stdins,
                                                  uid if mode == "none" else None)
    cfg = _sandbox_host.boot_config(mode, work, uid, script, len(stdins), timeout_s,
                                    limits.rlimits(), stop_on_timeout, work_mb)
    with open(os.path.join(io_dir, "config.json"), "w") as f:
      json.dump(cfg, f)
    boot_err = _run_supervisor(mode, stage, len(stdins), timeout_s)
    return _case_results(io_dir, boot_err, len(stdins), limits.output_cap_bytes)
  finally:
    if stage is not None:
      shutil.rmtree(stage, ignore_errors=True)
    _sandbox_host.release_uid(uid)


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
