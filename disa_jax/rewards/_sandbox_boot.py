"""Sandbox supervisor: runs inside the sandbox's namespaces and executes untrusted cases.

Executed as a script (`python -I -S _sandbox_boot.py`, standard library only) by
`disa_jax.rewards.sandbox`, with the staging directory S as its working directory:

  S/work/  the untrusted program's files (copied into the work tmpfs in the namespace modes; the
           program's cwd and HOME in mode none)
  S/io/    root-only: config.json, in_<i> (stdin of case i), out_<i>/err_<i>, result.json

When started by `unshare [--user --map-root-user] --mount --net --ipc --pid --fork --mount-proc`
it is PID 1 of a fresh PID namespace, in private mount and IPC namespaces without network. It then

1. caps System V IPC of its IPC namespace (`ipc_sysctls`: shared memory, message queues,
   semaphores); builds the program's root in a fresh tmpfs from an allow-list (`root`): the system
   trees (/usr, /lib, ...) and a few /etc files bound read-only, a fresh /etc/passwd and
   /etc/group, /dev/{null,zero,full,random,urandom}, a read-only 64 KiB /dev/shm, its /proc, a
   tmpfs of `work_mb` MiB at /tmp/home holding a copy of S/work (the program's only writable
   directory) and the Python install tree read-only at /tmp/python; pivots into it and detaches the
   host's tree (no /run, /var, /sys, /home, /root, ..., nor S); makes the root read-only and
   itself non-dumpable (no ptrace, no /proc/1/{cwd,environ,mem} for the program);
2. for each case forks a child that starts a new session, gets rlimits, (userns mode) enters a
   nested user + mount namespace as its only mapped uid (the sandbox's mounts become locked),
   drops the capability bounding set, sets no_new_privs, drops to the sandbox uid/gid (when one is
   given), clears every capability, checks all of that in /proc/self/status, changes into the work
   directory and execs the program with a scrubbed environment, stdin from in_<i> and
   stdout/stderr into fresh files out_<i>/err_<i> (RLIMIT_FSIZE caps them; opened without
   following symlinks);
3. waits for the child up to the per-case wall-clock timeout, then kills every process the case
   left behind (all processes of the namespace when PID 1; otherwise every descendant, found
   through /proc, which `setsid` cannot leave since the supervisor is a child subreaper, and every
   process of the dedicated uid) and reaps them; without an IPC namespace, it also removes the
   System V objects of the dedicated uid;
4. writes result.json: per case exit code, signal, timed_out, wall seconds, skipped.

The untrusted program never sees S/io (root-only, and outside its root), never sees the expected
outputs (they stay with the grader), and cannot signal this supervisor (a different uid, or, in
userns mode, PID 1 of its namespace with no signal handler).
"""

import ctypes
import ctypes.util
import errno
import json
import os
import resource
import select
import signal
import stat
import sys
import time

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384
MNT_DETACH = 2
PR_SET_CHILD_SUBREAPER = 36
PR_SET_DUMPABLE = 4
PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
CAP_SETPCAP = 8
CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
IPC_RMID = 0
_LINUX_CAPABILITY_VERSION_3 = 0x20080522
# pivot_root has no libc wrapper; its number on the architectures this was written for.
_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "loongarch64": 41}


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


def _bind(libc, src, dst, read_only):
  """Bind-mounts `src` (recursively) at `dst`, made like it (a directory or an empty file)."""
  if os.path.isdir(src):
    os.makedirs(dst, mode=0o755, exist_ok=True)
  else:
    os.close(os.open(dst, os.O_WRONLY | os.O_CREAT, 0o644))
  _mount(libc, src, dst, None, MS_BIND | MS_REC, None)
  if read_only:  # a noexec source stays noexec (a locked flag in userns mode)
    keep = MS_NOEXEC if os.statvfs(dst).f_flag & os.ST_NOEXEC else 0
    _mount(libc, "none", dst, None,
           MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | keep, None)


def _build_root(cfg, libc, new):
  """Makes the program's root in a fresh tmpfs at `new` from the allow-list `cfg["root"]`."""
  lay = cfg["root"]
  _mount(libc, "tmpfs", new, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m")
  for path, link in lay["tops"] + lay["etc"]:
    dst = new + path
    os.makedirs(os.path.dirname(dst), mode=0o755, exist_ok=True)
    if link is not None:
      os.symlink(link, dst)
    else:
      _bind(libc, path, dst, read_only=True)
  os.makedirs(new + "/etc", mode=0o755, exist_ok=True)
  for name in ("passwd", "group"):
    _write(f"{new}/etc/{name}", lay[name])
  os.makedirs(new + "/dev/shm", mode=0o755)
  for node in lay["dev"]:  # device nodes stay writable (/dev/null)
    _bind(libc, node, new + node, read_only=False)
  for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                       ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):
    os.symlink(target, f"{new}/dev/{name}")
  _mount(libc, "tmpfs", new + "/dev/shm", "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV,
         "mode=0755,size=64k")
  _bind(libc, "/proc", new + "/proc", read_only=False)  # writable: the nested uid_map
  home = new + cfg["home"]
  os.makedirs(home, mode=0o755)
  # The program's only writable directory: a private tmpfs of `work_mb` MiB (all its files
  # together), not the host's disk.
  _mount(libc, "tmpfs", home, "tmpfs", MS_NOSUID | MS_NODEV,
         f"mode=0700,size={int(cfg['work_mb'])}m")
  _copy_tree("work", home, cfg["uid"])
  if cfg["python_bind"]:
    # The interpreter's install tree, read-only, at a path the unprivileged uid can traverse.
    src, dst = cfg["python_bind"]
    _bind(libc, src, new + dst, read_only=True)
  for d in lay["hide"]:  # the grader's cwd or repository inside an allowed tree
    _mount(libc, "tmpfs", new + d, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, "mode=0755,size=4k")


def _pivot_root(libc, new, old):
  machine = os.uname().machine
  if machine not in _SYS_PIVOT_ROOT:
    raise OSError(errno.ENOSYS, f"pivot_root: no syscall number known for {machine}")
  if libc.syscall(_SYS_PIVOT_ROOT[machine], new.encode(), old.encode()) != 0:
    err = ctypes.get_errno()
    raise OSError(err, f"pivot_root {new}: {os.strerror(err)}")


def _setup_mounts(cfg, libc):
  """Pivots into the allow-listed root (see `_build_root`) and detaches the host's tree.

  The supervisor keeps its working directory (S, now unreachable by path) for io/.
  """
  os.umask(0o022)
  new = os.path.abspath("root")
  os.mkdir(new, 0o700)
  _build_root(cfg, libc, new)
  os.mkdir(new + "/.old", 0o700)
  _pivot_root(libc, new, new + "/.old")
  if libc.umount2(b"/.old", MNT_DETACH) != 0:
    raise OSError(ctypes.get_errno(), "umount2 /.old")
  os.rmdir("/.old")
  _mount(libc, "none", "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV, None)


def _limit_ipc(cfg):
  """Caps System V IPC in the sandbox's own IPC namespace (per-namespace sysctls)."""
  for name, value in cfg["ipc_sysctls"].items():
    try:
      _write(f"/proc/sys/{name}", value)
    except FileNotFoundError:
      continue  # a kernel without that kind of IPC
    except OSError:
      if cfg["ipc_strict"]:
        raise
      # userns mode on older kernels, where only the host's root may set them: defaults stay


def _pids_of_uid(uid):
  """Pids of the processes with `uid` among their real/effective/saved/fs uids or gids."""
  pids = []
  want = str(uid)
  for name in os.listdir("/proc"):
    if not name.isdigit():
      continue
    try:
      with open(f"/proc/{name}/status") as f:
        ids = [line.split()[1:] for line in f if line.startswith(("Uid:", "Gid:"))]
    except OSError:
      continue
    if any(want in row for row in ids):
      pids.append(int(name))
  return pids


def _descendants(root):
  """Pids of every descendant of process `root` (from the parent pids in /proc/*/stat)."""
  children = {}
  for name in os.listdir("/proc"):
    if not name.isdigit():
      continue
    try:
      with open(f"/proc/{name}/stat", "rb") as f:
        data = f.read()
    except OSError:
      continue
    children.setdefault(int(data[data.rindex(b")") + 2:].split()[1]), []).append(int(name))
  out, todo = [], [root]
  while todo:
    kids = children.get(todo.pop(), [])
    out += kids
    todo += kids
  return out


def _remove_ipc_of(uid, libc):
  """Removes the System V shared memory, message queues and semaphores owned or made by `uid`."""
  for kind, id_col in (("shm", "shmid"), ("msg", "msqid"), ("sem", "semid")):
    try:
      with open(f"/proc/sysvipc/{kind}") as f:
        lines = f.read().splitlines()
    except OSError:
      continue
    head = lines[0].split() if lines else []
    for line in lines[1:]:
      row = dict(zip(head, line.split()))
      if uid not in (int(row["uid"]), int(row["cuid"])):
        continue
      ident = int(row[id_col])
      if kind == "sem":
        libc.semctl(ident, 0, IPC_RMID)
      else:
        getattr(libc, kind + "ctl")(ident, IPC_RMID, None)


def _kill_case(cfg, pid, libc):
  """Kills everything case `pid` may have left behind and reaps it; returns its wait status.

  PID 1 of the sandbox's namespace kills every other process of it; otherwise (mode none) every
  descendant of the supervisor (orphans of the case come back to it, a child subreaper) and every
  process of the sandbox uid, until no child is left (at most 10 s).
  """
  status = None
  uid = cfg["uid"]
  pid1 = os.getpid() == 1 and cfg["pid_namespace"]
  deadline = time.monotonic() + 10.0
  while True:
    if pid1:
      targets = [-1]  # PID 1 of our own namespace: every other process in it
    else:
      targets = _descendants(os.getpid()) + (_pids_of_uid(uid) if uid is not None else [])
    for p in targets:
      try:
        os.kill(p, signal.SIGKILL)
      except (ProcessLookupError, PermissionError):
        pass
    try:
      got, st = os.waitpid(-1, os.WNOHANG)
    except ChildProcessError:
      break
    if got == pid:
      status = st
    if got == 0:
      if time.monotonic() > deadline:
        break
      time.sleep(0.001)
  if uid is not None and not cfg["mounts"]:
    _remove_ipc_of(uid, libc)
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


def _create_fresh(path):
  """A new file at `path` for writing (whatever was there removed; never through a symlink)."""
  try:
    os.unlink(path)
  except FileNotFoundError:
    pass
  return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)


def _open_stdin(path):
  """`path` when it is a regular file (opened without following a symlink), else /dev/null."""
  try:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
  except FileNotFoundError:
    return os.open(os.devnull, os.O_RDONLY)
  if not stat.S_ISREG(os.fstat(fd).st_mode):
    raise OSError(errno.EINVAL, f"{path} is not a regular file")
  return fd


def _child(cfg, i, libc):
  """In the forked child: limits, identity, exec. Never returns."""
  try:
    os.setsid()
    fin = _open_stdin(f"io/in_{i}")
    fout = _create_fresh(f"io/out_{i}")
    ferr = _create_fresh(f"io/err_{i}")
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
    _limit_ipc(cfg)
    _setup_mounts(cfg, libc)
  # Not dumpable: a program of the same host uid (userns mode) cannot ptrace the supervisor or
  # read its /proc/1/{cwd,environ,mem}; the flag resets in the case child at execve.
  libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
  if os.getpid() == 1:  # PID 1 gets only signals it has a handler for: keep none
    signal.signal(signal.SIGINT, signal.SIG_DFL)
  if not (os.getpid() == 1 and cfg["pid_namespace"]):
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:  # orphans of a case come to us
      raise OSError(ctypes.get_errno(), "PR_SET_CHILD_SUBREAPER")
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
    status = _kill_case(cfg, pid, libc)
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
  with os.fdopen(_create_fresh("io/result.json.tmp"), "w") as f:
    json.dump(results, f)
  os.rename("io/result.json.tmp", "io/result.json")


if __name__ == "__main__":
  try:
    main()
  except BaseException as e:  # pylint: disable=broad-except
    sys.stderr.write(f"sandbox supervisor failed: {type(e).__name__}: {e}\n")
    sys.exit(3)
