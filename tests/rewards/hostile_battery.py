"""The hostile battery of issues 24 and 39, run as a script in the mode `DISA_SANDBOX_MODE` names.

`python hostile_battery.py '<spec json>'` runs every attack program in the sandbox and prints one
JSON object: attack -> {"escaped": bool, "detail": str}. Each program's last line is
`ESCAPED: ...` when its attack worked and `blocked: ...` otherwise; a program that printed neither
(it crashed, or the sandbox did not run it) is reported as {"escaped": None, ...}, so a sandbox
that runs nothing cannot pass. A positive control (`control`) must print `blocked: ran`. Some rows
are decided here, after the run (a segment left behind, a process left behind, a stage left
behind, the grader's memory).

To keep it cheap, the attacks run as the cases of ONE `run_cases` call: a dispatcher `d_<tag>.py`
reads an attack's name from its stdin and executes that file. Only the setsid and FIFO attacks
run apart (a second call, with room for processes and under a watchdog: a grader that blocks on
the FIFO would hold the rest), and the output flood runs `code.run_humaneval` in a fresh
interpreter that measures its own peak RSS.

The spec holds: `secret`; `host_files` (paths of world-readable files holding `secret`, made by
the caller in the host's /tmp and in the repository); `outside` (paths outside the work dir to
write); `port` (a loopback TCP port this script listens on); `unix_socket` (where this script
listens on a unix socket: under /run, or another directory the sandbox must hide); `shm_key` (the
key of a world-readable System V segment holding `secret` that this script makes; the program's
own segment gets `shm_key + 1`); `work_mb` (the work tmpfs cap the caller set with
DISA_SANDBOX_WORK_MB); `nproc` (the fork-bomb limit); `memory_mb` and `total_memory_mb` (the limits
of the run: N processes together must stay under the total); `victim_uid` (root only, else null:
a process runs as it and the sandbox's uid draw is forced to return it, then 65534, first);
`flood_mb` (how much JSON the flooding candidate writes) and `rss_growth_mib` (the most the
grader's peak RSS may grow by while grading it).

Standard library plus `disa_jax.rewards` only (numpy too, in the flood's grader): it also runs as
an unprivileged uid under the system interpreter of the same version.
"""

import ctypes
import glob
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid

from disa_jax.rewards import sandbox

_COVERS = ["/tmp/home", "/tmp/python", "/tmp", "/usr", "/etc/ld.so.cache", "/dev/null", "/dev/shm",
           "/proc", "/", "/var/tmp", "/run/lock", "/work", "/home", "/root"]
_IPC_CREAT, _IPC_EXCL, _IPC_RMID, _SHM_RDONLY = 0o1000, 0o2000, 0, 0o10000
_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.shmat.restype = ctypes.c_void_p
_LIBC.shmat.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
_LIBC.shmdt.argtypes = [ctypes.c_void_p]


def fork_bomb_program(nproc: int) -> str:
  """Prints its uid, forks up to 200 sleeping children; ESCAPED if more than `nproc` started."""
  return ("import os, time\n"
          "print(os.getuid(), flush=True)\n"
          "n = 0\n"
          "for _ in range(200):\n"
          "  try:\n"
          "    pid = os.fork()\n"
          "  except OSError:\n"
          "    continue\n"
          "  if pid == 0:\n"
          "    time.sleep(30)\n"
          "    os._exit(0)\n"
          "  n += 1\n"
          f"print(('ESCAPED: %d processes' if n > {nproc} else 'blocked: %d processes') % n,\n"
          "      flush=True)\n"
          "os._exit(0)\n")


def _escape_programs(spec: dict) -> dict[str, str]:
  """Attacks on the mounts, the supervisor's /proc entries and the host's files."""
  secret = spec["secret"]
  return {
    "control": "print('blocked: ran')\n",
    "umount_covers": (
      "import ctypes, os\n"
      "libc = ctypes.CDLL(None, use_errno=True)\n"
      f"done = [t for t in {_COVERS!r} if libc.umount2(t.encode(), 2) == 0]\n"
      f"seen = [p for p in {spec['host_files']!r} if os.path.exists(p)]\n"
      "print(('ESCAPED: unmounted %s, then saw %s' % (done, seen)) if done else\n"
      "      'blocked: no cover could be unmounted')\n"),
    "unshare_then_umount": (  # its own user + mount namespace first: root there, caps there
      "import ctypes, os\n"
      "libc = ctypes.CDLL(None, use_errno=True)\n"
      "if libc.unshare(0x10000000 | 0x00020000) != 0:\n"
      "  print('blocked: unshare refused:', os.strerror(ctypes.get_errno()))\n"
      "else:\n"
      f"  done = [t for t in {_COVERS!r} if libc.umount2(t.encode(), 2) == 0]\n"
      f"  seen = [p for p in {spec['host_files']!r} if os.path.exists(p)]\n"
      "  print(('ESCAPED: unmounted %s, then saw %s' % (done, seen)) if done or seen else\n"
      "        'blocked: unshared, but the covers are locked')\n"),
    "proc1_cwd": (
      "import os\n"
      "try:\n"
      "  print('ESCAPED: /proc/1/cwd ->', os.readlink('/proc/1/cwd'), os.listdir('/proc/1/cwd'))\n"
      "except OSError as e:\n"
      "  print('blocked:', e)\n"),
    "proc1_environ": (
      "try:\n"
      "  print('ESCAPED: /proc/1/environ =', open('/proc/1/environ', 'rb').read()[:200])\n"
      "except OSError as e:\n"
      "  print('blocked:', e)\n"),
    "read_host_files": (
      "import os\n"
      "got = []\n"
      f"paths = {spec['host_files']!r}\n"
      "paths += ['/proc/1/cwd/../' + os.path.basename(p) for p in paths]  # the supervisor's cwd\n"
      "paths += ['/proc/1/root' + p for p in paths if p.startswith('/')]\n"
      "for p in paths:\n"
      "  try:\n"
      f"    if {secret!r} in open(p).read():\n"
      "      got.append(p)\n"
      "  except OSError:\n"
      "    pass\n"
      "print(('ESCAPED: read %s' % got) if got else 'blocked: no host file readable')\n"),
    "write_outside": (
      "import os\n"
      f"targets = {spec['outside']!r} + [os.path.expanduser('~/../w_{secret}')]\n"
      "done = []\n"
      "for t in targets:\n"
      "  try:\n"
      "    with open(t, 'w') as f:\n"
      "      f.write('x')\n"
      "    done.append(t)\n"
      "  except OSError:\n"
      "    pass\n"
      "print(('ESCAPED: wrote %s' % done) if done else 'blocked: nothing written outside')\n"),
  }


def _resource_programs(spec: dict) -> dict[str, str]:
  """Attacks on the host's disk, process table and network, and the program's privileges."""
  return {
    "disk_fill": (
      "import os\n"
      f"cap, total, chunk = {spec['work_mb']} * 2**20, 0, b'x' * 2**22\n"
      "try:\n"
      "  for i in range(3 * cap // len(chunk)):\n"
      "    with open(f'fill_{i}', 'wb') as f:\n"
      "      f.write(chunk)\n"
      "    total += len(chunk)\n"
      "except OSError:\n"
      "  pass\n"
      "for n in os.listdir('.'):\n"  # room for the attacks after it in the same work dir
      "  if n.startswith('fill_'):\n"
      "    os.unlink(n)\n"
      "print(('ESCAPED: wrote %d MiB' if total > cap else 'blocked: stopped at %d MiB')\n"
      "      % (total >> 20))\n"),
    "fork_bomb": fork_bomb_program(spec["nproc"]),
    "proc_host_processes": (  # /proc must be the sandbox's PID namespace only
      "import os\n"
      "seen = []\n"
      "for p in os.listdir('/proc'):\n"
      "  try:\n"
      "    if p.isdigit() and b'hostile_battery' in open(f'/proc/{p}/cmdline', 'rb').read():\n"
      "      seen.append(p)\n"
      "  except OSError:\n"
      "    pass\n"
      "print(('ESCAPED: the grader is visible as pid %s' % seen) if seen else\n"
      "      'blocked: %d processes visible' % sum(p.isdigit() for p in os.listdir('/proc')))\n"),
    "signal_supervisor": (  # the next case runs only if the supervisor survived
      "import os, signal\n"
      "for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGQUIT):\n"
      "  try:\n"
      "    os.kill(1, sig)\n"
      "  except OSError:\n"
      "    pass\n"
      "print('blocked: signals sent to pid 1')\n"),
    "socket_loopback": (
      "import socket\n"
      "try:\n"
      f"  socket.create_connection(('127.0.0.1', {spec['port']}), timeout=2).sendall(b'leak')\n"
      "  print('ESCAPED: connected to the host loopback')\n"
      "except OSError as e:\n"
      "  print('blocked:', e)\n"),
    "privileges": (
      "import os\n"
      "st = dict(l.split(':\\t', 1) for l in open('/proc/self/status').read().splitlines()\n"
      "          if ':\\t' in l)\n"
      "caps = {k: int(st[k], 16) for k in ('CapEff', 'CapPrm', 'CapBnd')}\n"
      "bad = os.getuid() == 0 or any(caps.values()) or st['NoNewPrivs'].strip() != '1'\n"
      "print('ESCAPED:' if bad else 'blocked:', 'uid', os.getuid(),\n"
      "      {k: hex(v) for k, v in caps.items()}, 'NoNewPrivs', st['NoNewPrivs'].strip())\n"),
  }


def _issue39_programs(spec: dict, victim: dict | None) -> dict[str, str]:
  """Issue 39: host unix sockets, System V IPC, aggregate memory, planted files, uid collision."""
  secret, key = spec["secret"], spec["shm_key"]
  shm = ("import ctypes, os\n"
         "libc = ctypes.CDLL(None, use_errno=True)\n"
         "libc.shmat.restype = ctypes.c_void_p\n"
         "libc.shmat.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]\n"
         "err = lambda: os.strerror(ctypes.get_errno())\n")
  progs = {
    "host_unix_socket": (
      "import os, socket\n"
      "run = os.listdir('/run') if os.path.isdir('/run') else []\n"
      "s = socket.socket(socket.AF_UNIX)\n"
      "s.settimeout(2)\n"
      "try:\n"
      f"  s.connect({spec['unix_socket']!r})\n"
      "  s.sendall(b'leak')\n"
      "  print('ESCAPED: connected to the host socket; /run holds', run[:5])\n"
      "except OSError as e:\n"
      "  print(('ESCAPED: /run holds %s' % run[:5]) if run else 'blocked: %s' % e)\n"),
    "sysv_shm_read": shm + (
      f"sid = libc.shmget({key}, 0, 0)\n"
      "if sid < 0:\n"
      "  print('blocked: shmget:', err())\n"
      "else:\n"
      f"  addr = libc.shmat(sid, None, {_SHM_RDONLY})\n"
      "  data = ctypes.string_at(addr, 64) if addr not in (None, 2**64 - 1) else b''\n"
      f"  print(('ESCAPED: read %r' % data) if {secret.encode()!r} in data else\n"
      "        'blocked: shmat: ' + err())\n"),
    "sysv_shm_make": shm + (  # the grader checks, after the run, whether it is still there
      f"sid = libc.shmget({key + 1}, 8 << 20, {_IPC_CREAT | 0o666})\n"
      "addr = libc.shmat(sid, None, 0) if sid >= 0 else None\n"
      "if addr in (None, 2**64 - 1):\n"
      "  print('blocked: no segment:', err())\n"
      "else:\n"
      f"  ctypes.memmove(addr, {secret.encode()!r}, {len(secret)})\n"
      "  libc.shmdt(ctypes.c_void_p(addr))\n"
      "  print('blocked: made an 8 MiB segment (the grader checks that it is gone)')\n"),
    "aggregate_memory": aggregate_memory_program(spec["total_memory_mb"]),
    "symlink_out": (  # reaches the stage only in mode none as the grader's uid
      "import os, sys\n"
      "out = os.path.join(os.path.dirname(os.getcwd()), 'io', 'out_%d' % CASE)\n"
      "try:\n"
      "  os.unlink(out)\n"
      f"  os.symlink({spec['host_files'][0]!r}, out)\n"
      "  sys.stderr.write('planted a symlink at %s\\n' % out)\n"
      "except OSError as e:\n"
      "  print('blocked: cannot reach the stage:', e)\n"),
  }
  if victim:
    progs["uid_collision"] = (
      "import os, signal\n"
      "hits = []\n"
      f"if os.getuid() in {victim['forced']!r}:\n"
      "  hits.append('runs as uid %d, which is in use' % os.getuid())\n"
      "try:\n"
      f"  os.kill({victim['pid']}, signal.SIGKILL)\n"
      "  hits.append('killed the victim')\n"
      "except OSError:\n"
      "  pass\n"
      "try:\n"
      f"  with open({victim['file']!r}, 'a') as f:\n"
      "    f.write('x')\n"
      "  hits.append('wrote the victim file')\n"
      "except OSError:\n"
      "  pass\n"
      "print(('ESCAPED: ' + ', '.join(hits)) if hits else 'blocked: uid %d' % os.getuid())\n")
  return progs


def aggregate_memory_program(total_mb: int) -> str:
  """Forks up to 16 children that each touch memory in 8 MiB chunks until MemoryError and hold it;
  ESCAPED if what they hold at once exceeds `total_mb`."""
  return ("import os, time\n"
          "r, w = os.pipe()\n"
          "kids = 0\n"
          "for _ in range(16):\n"
          "  try:\n"
          "    pid = os.fork()\n"
          "  except OSError:\n"
          "    break\n"
          "  if pid == 0:\n"
          "    held = []\n"
          "    try:\n"
          "      while True:\n"
          "        held.append(b'\\1' * (8 << 20))\n"
          "    except MemoryError:\n"
          "      pass\n"
          "    os.write(w, b'%d\\n' % (8 * len(held)))\n"
          "    time.sleep(20)\n"
          "    os._exit(0)\n"
          "  kids += 1\n"
          "os.close(w)\n"
          "with os.fdopen(r) as f:\n"
          "  total = sum(int(f.readline() or 0) for _ in range(kids))\n"
          f"print(('ESCAPED' if total > {total_mb} else 'blocked') +\n"
          f"      ': %d processes held %d MiB at once (cap {total_mb} MiB)' % (kids, total),\n"
          "      flush=True)\n"
          "os._exit(0)\n")


# Run apart from the others (`_run_apart`): generous process limits (a setsid attack that cannot
# fork proves nothing), and a grader that blocks on the FIFO must not hold the other attacks.
_APART = {
  "setsid_daemons": (
    "import os, time\n"
    "n = 0\n"
    "for k in range(5):\n"
    "  try:\n"
    "    pid = os.fork()\n"
    "  except OSError:\n"
    "    break\n"
    "  if pid == 0:\n"
    "    os.setsid()\n"
    "    if os.fork() == 0:\n"
    "      end = time.time() + 30\n"
    "      while k and time.time() < end:\n"  # 4 spinners; k == 0: a sleeping daemon
    "        pass\n"
    "      time.sleep(0 if k else 30)\n"
    "    os._exit(0)\n"
    "  os.waitpid(pid, 0)\n"
    "  n += 1\n"
    "print(('blocked: %d setsid processes started (the grader checks that none is left)' % n)\n"
    "      if n == 5 else 'started only %d of 5' % n)\n"),
  "fifo_out": (
    "import os, sys\n"
    "out = os.path.join(os.path.dirname(os.getcwd()), 'io', 'out_%d' % CASE)\n"
    "try:\n"
    "  os.unlink(out)\n"
    "  os.mkfifo(out)\n"
    "  sys.stderr.write('planted a FIFO at %s\\n' % out)\n"
    "except OSError as e:\n"
    "  print('blocked: cannot reach the stage:', e)\n"),
}
_DISPATCH = ("import sys\n"
             "name, case = sys.stdin.readline().split()\n"
             "g = {'__name__': '__main__', 'CASE': int(case)}\n"
             "exec(compile(open(name + '.py').read(), name + '.py', 'exec'), g)\n")
# A HumanEval completion that writes `%d` MiB of valid JSON into the runner's saved stdout (fd 3).
_FLOOD_COMPLETION = (
  "  return x\n"
  "import os\n"
  "doc = memoryview(b'{\"load_error\": null, \"check\": null, \"results\": [[\"ok\", ['\n"
  "                 + b'0,' * (%d << 19) + b'0]]]}')\n"
  "try:\n"
  "  while doc:\n"
  "    doc = doc[os.write(3, doc):]\n"
  "except OSError:\n"
  "  pass\n"
  "os._exit(0)\n")
# Run in a fresh interpreter with the completion as argv[1]: grades it and prints how much the
# grader's peak RSS grew (MiB) meanwhile.
_FLOOD_GRADER = """
import json, sys
from disa_jax.rewards import code
def rss_hwm():
  with open('/proc/self/status') as f:
    st = dict(line.split(':', 1) for line in f)
  return int(st['VmRSS'].split()[0]) >> 10, int(st['VmHWM'].split()[0]) >> 10
problem = {'task_id': 'flood/0', 'prompt': 'def f(x):', 'entry_point': 'f', 'atol': 0,
           'canonical_solution': '  return x', 'base_input': [[1]], 'plus_input': []}
code.humaneval_expected_outputs(problem, use_disk_cache=False)
with open('/proc/self/clear_refs', 'w') as f:
  f.write('5')  # resets VmHWM to the current RSS
rss0, _ = rss_hwm()
ok = code.run_humaneval(problem, sys.argv[1], timeout_s=30.0, run_check=False)
print(json.dumps({'ok': ok, 'growth_mib': rss_hwm()[1] - rss0}))
"""


def _serve(server: socket.socket, accepted: list, stop: threading.Event) -> None:
  while not stop.is_set():
    try:
      conn, _ = server.accept()
      accepted.append(conn.recv(100))
      conn.close()
    except OSError:
      pass


def _listen(family: int, address, stop: threading.Event) -> tuple[socket.socket, list]:
  """A server socket at `address` accepting (and recording) in a daemon thread."""
  server = socket.socket(family, socket.SOCK_STREAM)
  server.bind(address)
  if family == socket.AF_UNIX:
    os.chmod(address, 0o666)
  server.listen(4)
  server.settimeout(0.2)
  accepted: list = []
  threading.Thread(target=_serve, args=(server, accepted, stop), daemon=True).start()
  return server, accepted


def _shm_segment(key: int, data: bytes | None) -> int:
  """Makes a world-readable segment holding `data` (or, with None, looks one up); its id or -1."""
  sid = _LIBC.shmget(key, 4096 if data else 0, (_IPC_CREAT | _IPC_EXCL | 0o644) if data else 0)
  if data and sid < 0:
    raise OSError(ctypes.get_errno(), f"shmget({key}): {os.strerror(ctypes.get_errno())}")
  if data:
    addr = _LIBC.shmat(sid, None, 0)
    ctypes.memmove(addr, data, len(data))
    _LIBC.shmdt(addr)
  return sid


def _kill_a_grader(tag: str) -> str | None:
  """Starts a grader and SIGKILLs it while its case runs; returns its stage (None: not seen)."""
  pattern = os.path.join(tempfile.gettempdir(), "disa_sbx_*")
  before = set(glob.glob(pattern))
  child = subprocess.Popen([sys.executable, "-c",
                            "from disa_jax.rewards import sandbox\n"
                            f"sandbox.run_cases({{'stale_{tag}.py': 'import time; time.sleep(3)'}},"
                            f" 'stale_{tag}.py', [None], timeout_s=5)\n"])
  stage, deadline = None, time.monotonic() + 60
  while stage is None and time.monotonic() < deadline and child.poll() is None:
    time.sleep(0.05)
    stage = next((d for d in set(glob.glob(pattern)) - before
                  if os.path.exists(os.path.join(d, "work", f"stale_{tag}.py"))), None)
  child.kill()
  child.wait()
  return stage


def _wait_until_runs_as(proc: subprocess.Popen, uid: int, timeout_s: float = 30.0) -> None:
  """Blocks until process `proc` runs as `uid` (setpriv switches after Popen returns: a sandbox
  run drawing the uid before the switch would see it unused, a race of the battery, not a hole)."""
  deadline = time.monotonic() + timeout_s
  while time.monotonic() < deadline:
    try:
      with open(f"/proc/{proc.pid}/status") as f:
        uids = next(line.split()[1:] for line in f if line.startswith("Uid:"))
    except (OSError, StopIteration):
      uids = []
    if str(uid) in uids:
      return
    if proc.poll() is not None:
      raise RuntimeError(f"the victim process (uid {uid}) exited with {proc.returncode}")
    time.sleep(0.01)
  raise RuntimeError(f"the victim process {proc.pid} did not switch to uid {uid} in {timeout_s} s")


def _start_victim(uid: int, secret: str) -> dict:
  """A process and a private file of `uid`; the uid draw is forced to return it, then 65534."""
  path = os.path.join(tempfile.gettempdir(), f"disa_hostile_victim_{secret}")
  with open(path, "w") as f:
    f.write("victim\n")
  os.chown(path, uid, uid)
  os.chmod(path, 0o600)
  proc = subprocess.Popen(["setpriv", "--reuid", str(uid), "--regid", str(uid), "--clear-groups",
                           "sleep", "120"])
  _wait_until_runs_as(proc, uid)
  forced = [uid, 65534]
  draw = random.randrange

  def forced_draw(*args, **kwargs):
    return forced.pop(0) if forced and args == (1_000_000, 2_000_000) else draw(*args, **kwargs)

  random.randrange = forced_draw
  return {"pid": proc.pid, "proc": proc, "file": path, "forced": [uid, 65534]}


def _leftovers(tag: str) -> list[int]:
  """Live processes of the battery's sandbox (their command line names the dispatcher)."""
  out = []
  for p in os.listdir("/proc"):
    if not p.isdigit():
      continue
    try:
      with open(f"/proc/{p}/cmdline", "rb") as f, open(f"/proc/{p}/stat", "rb") as g:
        if f"d_{tag}.py".encode() in f.read() and g.read().rsplit(b")", 1)[1].split()[0] != b"Z":
          out.append(int(p))
    except OSError:
      pass
  return out


def _verdict(res: sandbox.CaseResult) -> dict:
  text = (res.stdout.decode(errors="replace").strip().splitlines() or [""])[-1]
  escaped = True if text.startswith("ESCAPED") else False if text.startswith("blocked") else None
  detail = text if escaped is not None else (
    f"exit {res.exit_code}, timed out {res.timed_out}: "
    f"{res.stderr.decode(errors='replace').strip()[-300:]}")
  return {"escaped": escaped, "detail": detail[:400]}


def _run_together(programs: dict[str, str], spec: dict, tag: str) -> dict[str, dict]:
  """Every program as one case of a single sandbox; attack -> row."""
  names = list(programs)
  files = {f"{n}.py": p for n, p in programs.items()}
  files[f"d_{tag}.py"] = _DISPATCH
  limits = sandbox.SandboxLimits(nproc=spec["nproc"], cpu_s=5, memory_mb=spec["memory_mb"],
                                 total_memory_mb=spec["total_memory_mb"])
  stdins = [f"{n} {i}".encode() for i, n in enumerate(names)]
  results = sandbox.run_cases(files, f"d_{tag}.py", stdins, timeout_s=5.0, limits=limits,
                              stop_on_timeout=False)
  out = {n: _verdict(r) for n, r in zip(names, results)}
  sym = results[names.index("symlink_out")]
  if spec["secret"].encode() in sym.stdout:
    out["symlink_out"] = {"escaped": True, "detail": "the grader read the symlink's target as "
                                                      f"the program's stdout: {sym.stdout[:80]!r}"}
  elif out["symlink_out"]["escaped"] is None and b"planted" in sym.stderr:
    out["symlink_out"] = {"escaped": False, "detail": "planted; the grader did not follow it"}
  after = results[names.index("signal_supervisor") + 1]
  if not after.ok:
    out["signal_supervisor"] = {"escaped": True, "detail": "the supervisor did not run the next "
                                                          f"case: {after.stderr[-200:]!r}"}
  return out


def _run_apart(tag: str) -> dict[str, dict]:
  """A setsid daemon + 4 spinners (for 30 s), then a FIFO planted as the program's own out file,
  in one sandbox whose grader runs under a 15 s watchdog (it needs well under a second); attack
  -> row (the leftovers are checked next, while the spinners would still run)."""
  box: list = []
  files = {f"{n}.py": p for n, p in _APART.items()}
  files[f"d_{tag}.py"] = _DISPATCH
  limits = sandbox.SandboxLimits(nproc=64, memory_mb=64, total_memory_mb=64 * 64, cpu_s=25)
  stdins = [f"{n} {i}".encode() for i, n in enumerate(_APART)]
  th = threading.Thread(target=lambda: box.append(sandbox.run_cases(
    files, f"d_{tag}.py", stdins, timeout_s=5.0, limits=limits, stop_on_timeout=False)),
                        daemon=True)
  th.start()
  th.join(15)
  if not box:
    return {"setsid_daemons": {"escaped": False, "detail": "(see the leftovers)"},
            "fifo_out": {"escaped": True, "detail": "the grader blocked for 15 s reading a FIFO"}}
  out = {n: _verdict(r) for n, r in zip(_APART, box[0])}
  if out["fifo_out"]["escaped"] is None and b"planted" in box[0][1].stderr:
    out["fifo_out"] = {"escaped": False, "detail": "planted; the grader did not block on it"}
  return out


def _flood_attack(spec: dict) -> dict:
  out = subprocess.run([sys.executable, "-c", _FLOOD_GRADER, _FLOOD_COMPLETION % spec["flood_mb"]],
                       capture_output=True, text=True, timeout=300)
  try:
    got = json.loads(out.stdout.strip().splitlines()[-1])
  except (ValueError, IndexError):
    return {"escaped": None, "detail": f"the flood grader failed: {out.stderr[-300:]}"}
  growth, cap = got["growth_mib"], spec["rss_growth_mib"]
  return {"escaped": growth > cap or got["ok"],
          "detail": f"{spec['flood_mb']} MiB of JSON: the grader's peak RSS grew {growth} MiB "
                    f"(at most {cap}); accepted: {got['ok']}"}


def run_battery(spec: dict) -> dict[str, dict]:
  """Runs every attack; attack -> {"escaped": True | False | None, "detail": str}."""
  tag = uuid.uuid4().hex[:12]
  sandbox.sandbox_mode()  # probed before the uid draw is forced
  stale = _kill_a_grader(tag)
  victim = _start_victim(spec["victim_uid"], spec["secret"]) if spec.get("victim_uid") else None
  programs = {**_escape_programs(spec), **_resource_programs(spec),
              **_issue39_programs(spec, victim)}
  out = _run_together(programs, spec, tag)
  out.update(_run_apart(tag))
  left = _leftovers(tag)
  for p in left:
    os.kill(p, signal.SIGKILL)
  if left:
    out["setsid_daemons"] = {"escaped": True, "detail": f"{len(left)} processes outlived the run"}
  made = _shm_segment(spec["shm_key"] + 1, None)
  if made >= 0:
    _LIBC.shmctl(made, _IPC_RMID, None)
    out["sysv_shm_make"] = {"escaped": True, "detail": "its segment outlived the run"}
  out["stale_stage"] = ({"escaped": None, "detail": "the killed grader's stage was not seen"}
                        if stale is None else
                        {"escaped": True, "detail": f"{stale} is left"} if os.path.exists(stale)
                        else {"escaped": False, "detail": "removed by the next grading"})
  if stale:
    shutil.rmtree(stale, ignore_errors=True)
  if victim:
    victim["proc"].poll()
    if victim["proc"].returncode is not None or open(victim["file"]).read() != "victim\n":
      out["uid_collision"] = {"escaped": True, "detail": "the victim process or file was hit"}
    victim["proc"].kill()
    victim["proc"].wait()
    os.unlink(victim["file"])
  out["output_flood"] = _flood_attack(spec)
  return out


def main() -> None:
  spec = json.loads(sys.argv[1])
  stop = threading.Event()
  tcp, tcp_got = _listen(socket.AF_INET, ("127.0.0.1", spec["port"]), stop)
  unix, unix_got = _listen(socket.AF_UNIX, spec["unix_socket"], stop)
  shm = _shm_segment(spec["shm_key"], f"grader segment {spec['secret']}".encode())
  try:
    out = run_battery(spec)
  finally:
    stop.set()
    tcp.close()
    unix.close()
    _LIBC.shmctl(shm, _IPC_RMID, None)
  if tcp_got and out["socket_loopback"]["escaped"] is False:
    out["socket_loopback"] = {"escaped": True, "detail": f"the server received {tcp_got}"}
  if unix_got and out["host_unix_socket"]["escaped"] is False:
    out["host_unix_socket"] = {"escaped": True, "detail": f"the server received {unix_got}"}
  print(json.dumps(out), flush=True)
  os._exit(0)  # a grader thread still blocked on a FIFO (the attack worked) must not hold us


if __name__ == "__main__":
  main()
