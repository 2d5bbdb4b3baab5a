"""`OpenAIEngine` against a stub completions server: the request it sends, the refusal of a server
that reports raw log-probs, named errors for a dead server or a foreign stop, and no weight
updates. The engine against a real `vllm serve`: test_served_vllm.py."""
import http.server
import json

import numpy as np
import pytest

from disa_jax import testing
from disa_jax.rollout import SamplingParams
from disa_jax.rollout.engines import EngineConfig
from disa_jax.rollout.openai_engine import OpenAIEngine, ServedEndpoint, ServedEngineError
from disa_jax.rollout.vllm_engine import derive_seed
from tests import http_stub

RAW, PROCESSED = -2.5, -1.25


class _Handler(http.server.BaseHTTPRequestHandler):
  """A vLLM-like /v1/completions: sampled tokens [7, 2] (or the server's `tokens`); log-probs
  PROCESSED per sampled token (RAW in raw mode), RAW for prompt_logprobs."""

  def do_POST(self):  # noqa: N802
    srv = self.server
    body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
    srv.requests.append(body)
    prompt = body["prompt"]
    if body.get("prompt_logprobs") is not None:
      choice = {"text": "", "index": 0, "finish_reason": "length", "logprobs": None,
                "prompt_logprobs": [None] + [{str(t): {"logprob": RAW, "rank": 1}}
                                             for t in prompt[1:]]}
    else:
      tokens = srv.tokens[:body["max_tokens"]]
      lp = RAW if srv.raw_mode else PROCESSED
      choice = {"text": "", "index": 0, "token_ids": tokens,
                "finish_reason": "stop" if tokens[-1] in srv.stops else "length",
                "logprobs": {"tokens": [f"token_id:{t}" for t in tokens],
                             "token_logprobs": [lp] * len(tokens), "top_logprobs": None,
                             "text_offset": [0] * len(tokens)}}
    http_stub.send_json(self, {"id": "x", "object": "text_completion", "created": 0,
                               "model": body["model"], "choices": [choice]})

  def log_message(self, *args):
    pass


@pytest.fixture
def server():
  with http_stub.serving(_Handler, requests=[], raw_mode=False, tokens=[7, 2], stops=(2,)) as srv:
    srv.url = f"http://127.0.0.1:{srv.server_address[1]}/v1"
    yield srv


def test_requests_token_ids_with_the_per_sample_seed_and_stop_ids(server):
  engine = EngineConfig(kind="openai", openai=ServedEndpoint(base_url=server.url, model="m")).make("unused")
  params = SamplingParams(n=2, temperature=0.6, top_p=0.95, max_tokens=5, seed=9,
                          stop_token_ids=(2, 3), return_raw_logprobs=True, prompt_index_offset=4)
  server.stops = (2, 3)
  out = engine.generate([[1, 5], [1, 6, 8]], params)
  c = out[1][0]
  assert c.token_ids.tolist() == [7, 2] and c.finish_reason == "stop"
  np.testing.assert_allclose(c.logprobs, [PROCESSED] * 2)
  np.testing.assert_allclose(c.raw_logprobs, [RAW] * 2)
  sampling = [r for r in server.requests[2:] if r.get("prompt_logprobs") is None]
  assert sorted(r["seed"] for r in sampling) == sorted(
      derive_seed(9, p + 4, j) for p in range(2) for j in range(2))
  r = sampling[0]
  assert r["prompt"] in ([1, 5], [1, 6, 8]) and r["stop_token_ids"] == [2, 3]
  assert r["ignore_eos"] is True and r["logprobs"] == 0 and r["return_token_ids"] is True
  assert (r["temperature"], r["top_p"], r["top_k"], r["repetition_penalty"]) == (0.6, 0.95, 0, 1.0)
  with pytest.raises(ServedEngineError, match="cannot be replaced"):
    engine.update_weights({})
  engine.close()


def test_a_server_reporting_raw_logprobs_is_refused(server):
  server.raw_mode = True
  with pytest.raises(ServedEngineError, match="--logprobs-mode processed_logprobs"):
    OpenAIEngine(ServedEndpoint(base_url=server.url, model="m"))
  OpenAIEngine(ServedEndpoint(base_url=server.url, model="m"), check_logprobs=False).close()


def test_a_stop_on_a_token_that_is_not_a_stop_id_is_named(server):
  server.stops = (2,)
  engine = OpenAIEngine(ServedEndpoint(base_url=server.url, model="m"))
  with pytest.raises(ServedEngineError, match=r"not one of stop_token_ids \(5,\)"):
    engine.generate([[1, 5]], SamplingParams(max_tokens=4, stop_token_ids=(5,)))
  engine.close()


def test_a_dead_server_gives_a_named_error():
  port = testing.free_port()  # nothing listens there
  with pytest.raises(ServedEngineError,
                     match=rf"served model 'm' at http://127.0.0.1:{port}/v1 failed a sampling "
                           rf"request \(after 0 retries\): APIConnectionError"):
    OpenAIEngine(ServedEndpoint(base_url=f"http://127.0.0.1:{port}/v1", model="m", max_retries=0))
