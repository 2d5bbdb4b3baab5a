"""Sandbox supervisor: runs inside the sandbox's namespaces and executes untrusted cases.

Executed as a script (`python -I -S _sandbox_boot.py`, standard library only) by
`disa_jax.rewards.sandbox`, with the staging directory S as its working directory:

  S/work/  the untrusted program's files (copied into the work tmpfs in the namespace modes; the
           program's cwd and HOME in mode none)
  S/io/    root-only: config.json, in_<i> (stdin of case i), out_<i>/err_<i>, result.json

When started by `unshare [--user --map-root-user] --mount --net --pid --fork --mount-proc` it is
PID 1 of a fresh PID namespace, in a private mount namespace without network. It then

1. covers the world-writable directories (/tmp, /var/tmp, /run/lock, /dev/shm) with small read-only
   tmpfs mounts, mounts a tmpfs of `work_mb` MiB at /tmp/home holding a copy of S/work (the
   program's only writable directory), bind-mounts the Python install tree read-only at
   /tmp/python, and hides the directories that hold user data (/root, /home, /work, /mnt, /opt,
   ..., the grader's cwd and repository) under empty read-only tmpfs (if `mounts` is set); makes
   itself non-dumpable (no ptrace, no /proc/1/{cwd,environ,mem} for the program);
2. for each case forks a child that starts a new session, gets rlimits, (userns mode) enters a
   nested user + mount namespace as its only mapped uid (the sandbox's mounts become locked),
   drops the capability bounding set, sets no_new_privs, drops to the sandbox uid/gid (when one is
   given), clears every capability, checks all of that in /proc/self/status, changes into the work
   directory and execs the program with a scrubbed environment, stdin from in_<i> and
   stdout/stderr into out_<i>/err_<i> (RLIMIT_FSIZE caps them);
3. waits for the child up to the per-case wall-clock timeout, then kills every process the case
   left behind (all processes of the namespace when PID 1, all processes of the dedicated uid
   otherwise, the child's process group as the last resort) and reaps them;
4. writes result.json: per case exit code, signal, timed_out, wall seconds, skipped.

The untrusted program never sees S/io (root-only, and hidden under the tmpfs), never sees the
expected outputs (they stay with the grader), and cannot signal this supervisor (a different uid,
or, in userns mode, PID 1 of its namespace with no signal handler).
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
PR_SET_DUMPABLE = 4
PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
CAP_SETPCAP = 8
CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
_LINUX_CAPABILITY_VERSION_3 = 0x20080522


def _libc():
  return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _mount(libc, source, target, fstype, flags, data):
  rc = libc.mount(source.encode(), target.encode(), fstype.encode() if fstype else None,
                  ctypes.c_ulong(flags), data.encode() if data else None)
  if rc != 0:
    err = ctypes.get_errno()
    raise OSError(err, f"mount {source} -> {target}: {os.strerror(err)}")


def _copy_tree(src, dst, uid):
  """Copies the program's files from `src` into `dst` (the work tmpfs), owned by `uid` if set."""
  for root, dirs, fnames in os.walk(src):
    rel = os.path.relpath(root, src)
    target = dst if rel == "." else os.path.join(dst, rel)
    for d in dirs:
      os.mkdir(os.path.join(target, d), 0o700)
    for fn in fnames:
      with open(os.path.join(root, fn), "rb") as fi, open(os.path.join(target, fn), "wb") as fo:
        fo.write(fi.read())
  if uid is not None:
    for root, dirs, fnames in os.walk(dst):
      for n in [root] + [os.path.join(root, x) for x in dirs + fnames]:
        os.chown(n, uid, uid)


def _setup_mounts(cfg, libc):
  """Hides world-writable directories and user data; the work dir is a size-capped tmpfs."""
  for d in cfg["cover"]:
    if os.path.isdir(d) and not os.path.islink(d):
      _mount(libc, "tmpfs", d, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=64k")
  home = cfg["home"]
  os.makedirs(home, mode=0o755, exist_ok=True)
  # The program's only writable directory: a private tmpfs of `work_mb` MiB (all its files
  # together), not the host's disk.
  _mount(libc, "tmpfs", home, "tmpfs", MS_NOSUID | MS_NODEV,
         f"mode=0700,size={int(cfg['work_mb'])}m")
  _copy_tree("work", home, cfg["uid"])
  if cfg["python_bind"]:
    # The interpreter's install tree, read-only, at a path the unprivileged uid can traverse.
    src, dst = cfg["python_bind"]
    os.makedirs(dst, mode=0o755, exist_ok=True)
    _mount(libc, src, dst, None, MS_BIND | MS_REC, None)
    _mount(libc, "none", dst, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV, None)
  for d in cfg["hide"]:  # user data (repository, datasets, home directories): empty, read-only
    if os.path.isdir(d) and not os.path.islink(d):
      _mount(libc, "tmpfs", d, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, "mode=0755,size=4k")
  for d in cfg["cover"]:  # read-only once the home mount point exists (the work tmpfs stays rw)
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


def _write(path, text):
  with open(path, "w") as f:
    f.write(text)


def _enter_nested_userns(libc, inner):
  """Userns mode: a user + mount namespace nested in the sandbox's, where we are uid `inner`.

  The sandbox's mounts, copied into a mount namespace owned by a less privileged user namespace,
  become locked: they cannot be unmounted or made writable from here even with capabilities. The
  single mapped uid/gid `inner` is the supervisor's (root of the outer namespace, the grader's uid
  on the host), so the work tmpfs stays the program's own.
  """
  if libc.unshare(CLONE_NEWUSER | CLONE_NEWNS) != 0:
    err = ctypes.get_errno()
    raise OSError(err, f"unshare(CLONE_NEWUSER | CLONE_NEWNS): {os.strerror(err)}")
  _write("/proc/self/uid_map", f"{inner} 0 1\n")
  _write("/proc/self/setgroups", "deny")
  _write("/proc/self/gid_map", f"{inner} 0 1\n")
  os.setresgid(inner, inner, inner)
  os.setresuid(inner, inner, inner)


def _status_fields():
  with open("/proc/self/status") as f:
    return dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)


def _drop_privileges(cfg, libc):
  """No capabilities (bounding set included), no_new_privs, an unprivileged uid; then checks them.

  Raises:
    OSError / PermissionError: when a step fails or the result is not what it must be (the case
      then fails with exit 126 instead of running the program with privileges).
  """
  if cfg["userns_uid"] is not None:
    _enter_nested_userns(libc, cfg["userns_uid"])
  if int(_status_fields()["CapEff"], 16) >> CAP_SETPCAP & 1:  # can shrink the bounding set
    with open("/proc/sys/kernel/cap_last_cap") as f:
      last = int(f.read())
    for cap in range(last + 1):
      if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"PR_CAPBSET_DROP {cap}")
  if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
    raise OSError(ctypes.get_errno(), "PR_SET_NO_NEW_PRIVS")
  if cfg["uid"] is not None:
    os.setgroups([])
    os.setresgid(cfg["gid"], cfg["gid"], cfg["gid"])
    os.setresuid(cfg["uid"], cfg["uid"], cfg["uid"])
  header = (ctypes.c_uint32 * 2)(_LINUX_CAPABILITY_VERSION_3, 0)
  data = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable of 2 words: all zero
  if libc.capset(header, data) != 0:
    raise OSError(ctypes.get_errno(), "capset to no capabilities")
  st = _status_fields()
  strict = cfg["mounts"] or cfg["uid"] is not None  # a non-root grader in mode none keeps its uid
  if (int(st["CapEff"], 16) or int(st["CapPrm"], 16) or st["NoNewPrivs"].strip() != "1" or
      (strict and (int(st["CapBnd"], 16) or os.getuid() == 0))):
    raise PermissionError(f"privileges left: uid {os.getuid()}, CapEff {st['CapEff']}, "
                          f"CapBnd {st['CapBnd']}, NoNewPrivs {st['NoNewPrivs']}")


def _child(cfg, i, libc):
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
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    _drop_privileges(cfg, libc)
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
  # Not dumpable: a program of the same host uid (userns mode) cannot ptrace the supervisor or
  # read its /proc/1/{cwd,environ,mem}; the flag resets in the case child at execve.
  libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
  if os.getpid() == 1:  # PID 1 gets only signals it has a handler for: keep none
    signal.signal(signal.SIGINT, signal.SIG_DFL)
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
      _child(cfg, i, libc)
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
