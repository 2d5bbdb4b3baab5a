"""The hostile battery of issue 24, run as a script in the sandbox mode `DISA_SANDBOX_MODE` names.

`python hostile_battery.py '<spec json>'` runs every attack program in the sandbox (one `run_cases`
each) and prints one JSON object: attack -> {"escaped": bool, "detail": str}. Each program's last
line is `ESCAPED: ...` when its attack worked and `blocked: ...` otherwise; a program that printed
neither (it crashed, or the sandbox did not run it) is reported as {"escaped": None, ...}, so a
sandbox that runs nothing cannot pass. A positive control (`control`) must print `blocked: ran`.

The spec holds: `secret`; `host_files` (paths of world-readable files holding `secret`, made by
the caller in the host's /tmp and in the repository); `outside` (paths outside the work dir to
write); `port` (a loopback TCP port this script listens on); `work_mb` (the work tmpfs cap the
caller set with DISA_SANDBOX_WORK_MB); `nproc` (the fork-bomb limit).

Standard library plus `disa_jax.rewards.sandbox` only: it also runs as an unprivileged uid under the
system interpreter (userns mode).
"""

import json
import socket
import sys
import threading

from disa_jax.rewards import sandbox

_COVERS = ["/tmp/home", "/tmp", "/var/tmp", "/dev/shm", "/run/lock", "/work", "/home", "/root",
           "/proc"]


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


def _serve(server: socket.socket, accepted: list, stop: threading.Event) -> None:
  while not stop.is_set():
    try:
      conn, _ = server.accept()
      accepted.append(conn.recv(100))
      conn.close()
    except OSError:
      pass


def run_battery(spec: dict) -> dict[str, dict]:
  """Runs every attack; attack -> {"escaped": True | False | None, "detail": str}."""
  out = {}
  for name, prog in {**_escape_programs(spec), **_resource_programs(spec)}.items():
    limits = sandbox.SandboxLimits(nproc=spec["nproc"], cpu_s=5)
    stdins = [None, None] if name == "signal_supervisor" else [None]
    results = sandbox.run_cases({"p.py": prog}, "p.py", stdins, timeout_s=5.0, limits=limits,
                                stop_on_timeout=False)
    res = results[0]
    text = (res.stdout.decode(errors="replace").strip().splitlines() or [""])[-1]
    if len(results) == 2 and not results[1].ok:
      text = f"ESCAPED: the supervisor did not run the next case: {results[1].stderr[-200:]!r}"
    escaped = True if text.startswith("ESCAPED") else False if text.startswith("blocked") else None
    detail = text if escaped is not None else (
      f"exit {res.exit_code}, timed out {res.timed_out}: "
      f"{res.stderr.decode(errors='replace').strip()[-300:]}")
    out[name] = {"escaped": escaped, "detail": detail[:400]}
  return out


def main() -> None:
  spec = json.loads(sys.argv[1])
  server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
  server.bind(("127.0.0.1", spec["port"]))
  server.listen(4)
  server.settimeout(0.2)
  accepted: list = []
  stop = threading.Event()
  th = threading.Thread(target=_serve, args=(server, accepted, stop), daemon=True)
  th.start()
  try:
    out = run_battery(spec)
  finally:
    stop.set()
    th.join()
    server.close()
  if accepted and out["socket_loopback"]["escaped"] is False:
    out["socket_loopback"] = {"escaped": True, "detail": f"the server received {accepted}"}
  print(json.dumps(out))


if __name__ == "__main__":
  main()
