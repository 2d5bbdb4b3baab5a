"""Grader-side helpers of the code sandbox (`disa_jax.rewards.sandbox`).

- Stage directories: `make_stage` names each one after the grader that owns it
  (``disa_sbx_<pid namespace>_<pid>_<start time>_*``), and `sweep_stale_stages` removes those of
  graders that died without cleaning up (SIGKILL, the OOM killer): their pid is gone, or now
  belongs to a process with another start time.
- Fresh uids: `acquire_uid` draws a uid for one sandbox (root graders only) and keeps it only if no
  passwd or group entry names it and no process has it among its uids or gids; `release_uid`
  hands it back.
- Safe reads: `read_regular` reads at most a cap of a regular file, without following a symlink
  and without blocking on a FIFO, so that a program that planted one in the stage (mode `none`,
  same uid as the grader) can neither hang nor redirect the grader.
- The program's root (namespace modes): `root_layout` is the allow-list of host paths the
  supervisor puts into the fresh root it pivots into; every other host directory is absent.
- The stage's contents: `write_work_files` (the program's files, the stdins) and `boot_config`
  (the supervisor's config.json: the interpreter, the environment, the root, the IPC caps, the
  rlimits).
"""

from __future__ import annotations

import grp
import os
import pwd
import random
import shutil
import stat
import sys
import tempfile
import threading
from typing import Mapping, Sequence

from disa_jax.rewards._sandbox_boot import _pids_of_uid

_USERNS_UID = 1000  # the program's uid in the nested user namespace of userns mode
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_HOME_NS = "/tmp/home"
# System V IPC caps of the sandbox's IPC namespace (per-namespace sysctls under /proc/sys).
_SHM_MB = 16
_IPC_SYSCTLS = {
  "kernel/shmmax": str(_SHM_MB << 20),  # bytes per segment
  "kernel/shmall": str((_SHM_MB << 20) // os.sysconf("SC_PAGE_SIZE")),  # pages in all
  "kernel/shmmni": "16",  # segments
  "kernel/msgmni": "16",  # message queues (16 KiB each by default)
  "kernel/sem": "250 4000 32 16",  # per set, in all, per semop, sets
  "fs/mqueue/queues_max": "16",  # POSIX message queues (80 KiB each by default)
}
STAGE_PREFIX = "disa_sbx_"
UID_RANGE = (1_000_000, 2_000_000)  # fresh sandbox uids (root graders)
# The host paths the program sees (namespace modes): the interpreter's system libraries and tools,
# read-only. Top-level symlinks (/bin -> usr/bin on merged-usr systems) are recreated as links.
ROOT_TOPS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/nix", "/gnu")
# The /etc entries the dynamic loader and the standard library read (symlinks are recreated);
# /etc/passwd and /etc/group are written fresh, naming only root, nobody and the sandbox uid.
ETC_ENTRIES = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "timezone",
               "nsswitch.conf", "alternatives", "os-release")
DEV_NODES = ("null", "zero", "full", "random", "urandom")

_UIDS_HELD: set[int] = set()  # uids of this process's running sandboxes
_UID_LOCK = threading.Lock()


def _start_time(pid: int) -> int | None:
  """Field 22 of /proc/<pid>/stat (start time in clock ticks after boot); None if no such pid."""
  try:
    with open(f"/proc/{pid}/stat", "rb") as f:
      data = f.read()
  except OSError:
    return None
  return int(data[data.rindex(b")") + 2:].split()[19])


def _pid_namespace() -> int:
  return os.stat("/proc/self/ns/pid").st_ino


def make_stage() -> str:
  """A fresh stage directory in the temp dir, named after this grader (pid ns, pid, start time)."""
  pid = os.getpid()
  return tempfile.mkdtemp(prefix=f"{STAGE_PREFIX}{_pid_namespace()}_{pid}_{_start_time(pid)}_")


def sweep_stale_stages(tmpdir: str | None = None) -> list[str]:
  """Removes the stage directories (of this user) whose grader is dead.

  Only directories named by `make_stage` in this PID namespace are considered (a pid of another
  namespace says nothing about its owner); the owner is dead when its pid is gone or its start
  time differs (the pid was reused).

  Args:
    tmpdir: where the stages are (default: `tempfile.gettempdir()`).

  Returns:
    The removed paths.
  """
  tmpdir = tmpdir or tempfile.gettempdir()
  try:
    names = [n for n in os.listdir(tmpdir) if n.startswith(STAGE_PREFIX)]
  except OSError:
    return []
  ns, uid, removed = _pid_namespace(), os.geteuid(), []
  for name in names:
    parts = name[len(STAGE_PREFIX):].split("_")
    if len(parts) < 4 or not all(p.isdigit() for p in parts[:3]) or int(parts[0]) != ns:
      continue
    if _start_time(int(parts[1])) == int(parts[2]):
      continue  # its grader is alive
    path = os.path.join(tmpdir, name)
    try:
      st = os.lstat(path)
    except OSError:
      continue
    if stat.S_ISDIR(st.st_mode) and st.st_uid == uid:
      shutil.rmtree(path, ignore_errors=True)
      removed.append(path)
  return removed


def uid_in_use(uid: int) -> bool:
  """Whether a passwd or group entry names `uid`, or a process has it among its uids or gids."""
  for lookup in (pwd.getpwuid, grp.getgrgid):
    try:
      lookup(uid)
      return True
    except KeyError:
      pass
  return bool(_pids_of_uid(uid))


def acquire_uid(tries: int = 64) -> int:
  """A fresh uid in `UID_RANGE` that nothing uses (see `uid_in_use`), held until `release_uid`.

  Raises:
    RuntimeError: when `tries` draws found no unused uid.
  """
  for _ in range(tries):
    uid = random.randrange(*UID_RANGE)
    with _UID_LOCK:
      if uid in _UIDS_HELD:
        continue
    if uid_in_use(uid):
      continue
    with _UID_LOCK:
      if uid not in _UIDS_HELD:
        _UIDS_HELD.add(uid)
        return uid
  raise RuntimeError(f"no unused uid in [{UID_RANGE[0]}, {UID_RANGE[1]}) after {tries} draws")


def release_uid(uid: int | None) -> None:
  if uid is not None:
    with _UID_LOCK:
      _UIDS_HELD.discard(uid)


def read_regular(path: str, cap: int) -> bytes | None:
  """At most `cap` bytes of the regular file `path`.

  Opened with O_NOFOLLOW and O_NONBLOCK and checked with fstat: a symlink, a FIFO, a device, a
  directory or a file with another hard link is not read.

  Returns:
    The bytes, or None when `path` is missing or not a regular file of one link.
  """
  try:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
  except OSError:
    return None
  try:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
      return None
    chunks, left = [], min(cap, st.st_size)
    while left > 0:
      chunk = os.read(fd, left)
      if not chunk:
        break
      chunks.append(chunk)
      left -= len(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)
  finally:
    os.close(fd)


def _under(path: str, tops: list[str]) -> bool:
  return any(path == t or path.startswith(t.rstrip("/") + "/") for t in tops)


def root_layout(uid: int, extra_hidden: list[str]) -> dict:
  """The allow-list of host paths in the program's root (namespace modes).

  Args:
    uid: the program's uid (named in the fresh /etc/passwd and /etc/group).
    extra_hidden: directories (the grader's cwd, the repository) to cover with an empty tmpfs when
      they lie inside an allowed tree.

  Returns:
    {"tops": [[path, link target or None], ...] (None: bind the directory read-only),
     "etc": [[path, link target or None], ...], "dev": [device node paths],
     "passwd": str, "group": str, "hide": [paths]}.
  """
  def entries(paths):
    out = []
    for p in paths:
      if os.path.islink(p):
        out.append([p, os.readlink(p)])
      elif os.path.exists(p):
        out.append([p, None])
    return out

  tops = entries(ROOT_TOPS)
  bound = [os.path.realpath(p) for p, link in tops if link is None]
  hidden = sorted({os.path.realpath(d) for d in extra_hidden
                   if os.path.isdir(d) and _under(os.path.realpath(d), bound)})
  return {
    "tops": tops,
    "etc": entries([os.path.join("/etc", e) for e in ETC_ENTRIES]),
    "dev": [os.path.join("/dev", d) for d in DEV_NODES if os.path.exists(os.path.join("/dev", d))],
    "passwd": (f"root:x:0:0:root:/root:/usr/sbin/nologin\n"
               f"sandbox:x:{uid}:{uid}:sandbox:/tmp/home:/usr/sbin/nologin\n"
               f"nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"),
    "group": f"root:x:0:\nsandbox:x:{uid}:\nnogroup:x:65534:\n",
    "hide": hidden,
  }


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


def write_work_files(stage: str, mode: str, files: Mapping[str, str | bytes],
                     stdins: Sequence[bytes | None], uid: int | None) -> tuple[str, str]:
  """Creates the stage's private work directory (the program's files) and io directory (stdins).

  Args:
    stage: the stage directory (fresh, from `make_stage`).
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


def boot_config(mode: str, work: str, uid: int | None, script: str, num_cases: int,
                timeout_s: float, rlimits: dict[str, int], stop_on_timeout: bool,
                work_mb: int) -> dict:
  """The supervisor's ``config.json`` (read by `_sandbox_boot.py`).

  Args:
    mode: the isolation mode.
    work: the private work directory (HOME without namespaces).
    uid: the sandbox uid and gid, or None to keep the grader's.
    script: the file to run, relative to the work directory.
    num_cases: number of cases (stdins).
    timeout_s: wall-clock bound of each case.
    rlimits: resource name -> limit (`SandboxLimits.rlimits`).
    stop_on_timeout: skip the remaining cases after a timeout.
    work_mb: size of the work tmpfs (namespace modes).

  Returns:
    The JSON-ready supervisor config: mounts, the program's root (allow-list), IPC caps, work
    tmpfs size, the nested-namespace uid, uid, rlimits, the program's argv and environment, and
    the case settings.
  """
  mounts = mode in ("ns", "userns")
  home = _HOME_NS if mounts else work
  python, python_bind = _interpreter(mode, uid is not None)
  env = _scrubbed_env(home)
  if python_bind:  # the interpreter's RUNPATH may point into a hidden directory
    env["LD_LIBRARY_PATH"] = python_bind[1] + "/lib"
  program_uid = _USERNS_UID if mode == "userns" else uid
  return {
    "mounts": mounts,
    "pid_namespace": mounts,
    "root": root_layout(program_uid, [os.getcwd(), _REPO]) if mounts else None,
    "ipc_sysctls": _IPC_SYSCTLS if mounts else {},
    "ipc_strict": mode == "ns",
    "home": home,
    "uid": uid,
    "gid": uid,
    "userns_uid": _USERNS_UID if mode == "userns" else None,
    "work_mb": work_mb,
    "rlimits": rlimits,
    "python_bind": python_bind,
    "argv": [python, "-I", "-S", "-c", _LAUNCH, script],
    "env": env,
    "num_cases": num_cases,
    "timeout_s": float(timeout_s),
    "stop_on_timeout": bool(stop_on_timeout),
  }
