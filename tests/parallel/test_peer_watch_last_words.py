"""The line naming a lost peer is stderr's last line, whole, while another thread is printing.

The CI failure this guards against (2026-12-07): the survivor's main thread was writing the
traceback of its failed all-gather when the watcher wrote its line, which landed after a half line
(``^^^^error: process 0 ...``) and before the rest of the traceback."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_CHILD = textwrap.dedent("""
    import os, sys, threading, time
    from disa_jax.parallel import peer_watch

    def chatter():  # a traceback being printed piece by piece, and C++ logging to fd 2
      while True:
        sys.stderr.write("^^^^")
        os.write(2, b"~~~~")
    threading.Thread(target=chatter, daemon=True).start()
    time.sleep(0.2)
    peer_watch._last_words("error: process 1 of 2 is lost")
    os._exit(peer_watch.EXIT_CODE)
""")


def test_the_lost_peer_line_is_whole_and_last_while_another_thread_prints():
  for _ in range(3):
    r = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu"))
    assert r.returncode == 75, r.stderr[-2000:]
    lines = [l for l in r.stderr.splitlines() if "error: " in l]
    assert lines == ["error: process 1 of 2 is lost"], r.stderr[-500:]
    assert r.stderr.endswith("\nerror: process 1 of 2 is lost\n"), r.stderr[-500:]


_CHILD_FDS = textwrap.dedent("""
    import json, os
    from disa_jax.parallel import peer_watch
    before = sorted(os.listdir("/proc/self/fd"))
    peer_watch._last_words("error: process 1 of 2 is lost")
    after = sorted(os.listdir("/proc/self/fd"))
    os.write(1, json.dumps([before, after]).encode())
""")


def test_the_last_words_leave_no_descriptor_open():
  """Only fd 2 changes (to /dev/null): the copy of the old stderr and the /dev/null descriptor it
  was taken from are closed."""
  r = subprocess.run([sys.executable, "-c", _CHILD_FDS], capture_output=True, text=True, timeout=60,
                     env=dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu"))
  assert r.returncode == 0 and r.stderr.endswith("error: process 1 of 2 is lost\n"), r.stderr
  before, after = json.loads(r.stdout)
  assert before == after, (before, after)
