"""Sandbox supervisor: runs inside the sandbox's namespaces and executes untrusted cases.

Executed as a script (`python -I -S _sandbox_boot.py`, standard library only) by
`disa_jax.rewards.sandbox`, with the staging directory S as its working directory:

  S/work/  the untrusted program's files; becomes its cwd and HOME (owned by the sandbox uid)
  S/io/    root-only: config.json, in_<i> (stdin of case i), out_<i>/err_<i>, result.json

When started by `unshare --mount --net --pid --fork --mount-proc` it is PID 1 of a fresh PID
namespace, in a private mount namespace without network. It then

1. covers the world-writable directories (/tmp, /var/tmp, /run/lock, /dev/shm) with small read-only
   tmpfs mounts, bind-mounts S/work at /tmp/home and the Python install tree read-only at
   /tmp/python, and hides the directories that hold user data (/root, /home, /work, /mnt, /opt,
   ..., the grader's cwd and repository) under empty read-only tmpfs (if `mounts` is set);
2. for each case forks a child that starts a new session, gets rlimits, drops to the sandbox uid/gid
   (when one is given), changes into the work directory and execs the program with a scrubbed
   environment, stdin from in_<i> and stdout/stderr into out_<i>/err_<i> (RLIMIT_FSIZE caps them);
3. waits for the child up to the per-case wall-clock timeout, then kills every process the case
   left behind (all processes of the namespace when PID 1, all processes of the dedicated uid
   otherwise, the child's process group as the last resort) and reaps them;
4. writes result.json: per case exit code, signal, timed_out, wall seconds, skipped.

The untrusted program never sees S/io (root-only, and hidden under the tmpfs), never sees the
expected outputs (they stay with the grader), and cannot signal this supervisor (different uid).
"""

import ctypes
import ctypes.util
import json
import os
import resource
import select
import signal
import sys
import time

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384
PR_SET_CHILD_SUBREAPER = 36


def _libc():
  return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _mount(libc, source, target, fstype, flags, data):
  rc = libc.mount(source.encode(), target.encode(), fstype.encode() if fstype else None,
                  ctypes.c_ulong(flags), data.encode() if data else None)
  if rc != 0:
    err = ctypes.get_errno()
    raise OSError(err, f"mount {source} -> {target}: {os.strerror(err)}")


def _setup_mounts(cfg, libc):
  """Hides world-writable directories and exposes S/work at cfg['home']."""
  work_fd = os.open("work", os.O_RDONLY | os.O_DIRECTORY)
  for d in cfg["cover"]:
    if os.path.isdir(d) and not os.path.islink(d):
      _mount(libc, "tmpfs", d, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=64k")
  home = cfg["home"]
  os.makedirs(home, mode=0o755, exist_ok=True)
  _mount(libc, f"/proc/self/fd/{work_fd}", home, None, MS_BIND, None)
  os.close(work_fd)
  if cfg["python_bind"]:
    # The interpreter's install tree, read-only, at a path the unprivileged uid can traverse.
    src, dst = cfg["python_bind"]
    os.makedirs(dst, mode=0o755, exist_ok=True)
    _mount(libc, src, dst, None, MS_BIND | MS_REC, None)
    _mount(libc, "none", dst, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV, None)
  for d in cfg["hide"]:  # user data (repository, datasets, home directories): empty, read-only
    if os.path.isdir(d) and not os.path.islink(d):
      _mount(libc, "tmpfs", d, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, "mode=0755,size=4k")
  for d in cfg["cover"]:  # read-only once the home mount point exists (the bind stays writable)
    if os.path.isdir(d) and not os.path.islink(d):
      _mount(libc, "tmpfs", d, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, None)


def _pids_of_uid(uid):
  pids = []
  for name in os.listdir("/proc"):
    if not name.isdigit():
      continue
    try:
      with open(f"/proc/{name}/status") as f:
        for line in f:
          if line.startswith("Uid:"):
            if int(line.split()[1]) == uid:
              pids.append(int(name))
            break
    except OSError:
      continue
  return pids


def _kill_case(cfg, pid):
  """Kills everything case `pid` may have left behind and reaps it; returns its wait status."""
  status = None
  uid = cfg["uid"]
  pid1 = os.getpid() == 1 and cfg["pid_namespace"]
  for _ in range(1000):
    if pid1:
      try:
        os.kill(-1, signal.SIGKILL)  # PID 1 of our own namespace: every other process in it
      except ProcessLookupError:
        pass
    elif uid is not None:
      for p in _pids_of_uid(uid):
        try:
          os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
          pass
    else:
      try:
        os.killpg(pid, signal.SIGKILL)
      except (ProcessLookupError, PermissionError):
        pass
    try:
      got, st = os.waitpid(-1, 0 if (pid1 or uid is not None) else os.WNOHANG)
    except ChildProcessError:
      break
    if got == pid:
      status = st
    if got == 0:
      break
  if status is None:
    try:
      _, status = os.waitpid(pid, 0)
    except ChildProcessError:
      pass
  return status


def _wait_exit(pid, timeout_s):
  """True once `pid` has exited (it stays unreaped), False after `timeout_s`."""
  try:
    pidfd = os.pidfd_open(pid)
  except (AttributeError, OSError):
    pidfd = None
  if pidfd is not None:
    try:
      ready, _, _ = select.select([pidfd], [], [], timeout_s)
    finally:
      os.close(pidfd)
    return bool(ready)
  deadline = time.monotonic() + timeout_s  # old kernels: poll without reaping
  while time.monotonic() < deadline:
    try:
      if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
        return True
    except ChildProcessError:
      return True
    time.sleep(0.005)
  return False


def _child(cfg, i):
  """In the forked child: limits, identity, exec. Never returns."""
  try:
    os.setsid()
    fin = os.open(f"io/in_{i}", os.O_RDONLY) if os.path.exists(f"io/in_{i}") else os.open(
      os.devnull, os.O_RDONLY)
    fout = os.open(f"io/out_{i}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    ferr = os.open(f"io/err_{i}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(fin, 0)
    os.dup2(fout, 1)
    os.dup2(ferr, 2)
    os.closerange(3, 65536)
    for name, value in cfg["rlimits"].items():
      resource.setrlimit(getattr(resource, name), (value, value))
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    if cfg["uid"] is not None:
      os.setgroups([])
      os.setgid(cfg["gid"])
      os.setuid(cfg["uid"])
    os.chdir(cfg["home"])
    os.umask(0o077)
    os.execve(cfg["argv"][0], cfg["argv"], cfg["env"])
  except BaseException as e:  # pylint: disable=broad-except
    try:
      os.write(2, f"sandbox: cannot start the program: {type(e).__name__}: {e}\n".encode())
    finally:
      os._exit(126)


def main():
  with open("io/config.json") as f:
    cfg = json.load(f)
  libc = _libc()
  if cfg["mounts"]:
    _setup_mounts(cfg, libc)
  if not (os.getpid() == 1 and cfg["pid_namespace"]):
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)  # orphans of a case come back to us
  results = []
  stop = False
  for i in range(cfg["num_cases"]):
    if stop:
      results.append({"skipped": True, "timed_out": False, "exit": None, "signal": None,
                      "wall_s": 0.0})
      continue
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:
      _child(cfg, i)
    timed_out = not _wait_exit(pid, cfg["timeout_s"])
    wall = time.monotonic() - t0
    status = _kill_case(cfg, pid)
    exit_code = sig = None
    if status is not None:
      if os.WIFEXITED(status):
        exit_code = os.WEXITSTATUS(status)
      elif os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
    results.append({"skipped": False, "timed_out": timed_out, "exit": exit_code, "signal": sig,
                    "wall_s": wall})
    if timed_out and cfg["stop_on_timeout"]:
      stop = True
  with open("io/result.json.tmp", "w") as f:
    json.dump(results, f)
  os.rename("io/result.json.tmp", "io/result.json")


if __name__ == "__main__":
  try:
    main()
  except BaseException as e:  # pylint: disable=broad-except
    sys.stderr.write(f"sandbox supervisor failed: {type(e).__name__}: {e}\n")
    sys.exit(3)
