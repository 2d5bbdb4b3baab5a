"""Diversity: the App. D.5 judge against a local OpenAI-compatible server, and the local metric."""

import http.server
import json
import re
import time

import numpy as np
import pytest

from disa_jax import testing
from disa_jax.eval import diversity as dv
from tests import http_stub


class _Handler(http.server.BaseHTTPRequestHandler):
  """Chat-completions stub: replies per the server's `plan` (list of (status, content))."""

  def do_POST(self):  # noqa: N802
    srv = self.server
    body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
    srv.requests.append({"path": self.path, "body": body,
                         "auth": self.headers.get("Authorization")})
    status, content = srv.plan.pop(0) if srv.plan else (200, "3")
    if status != 200:
      http_stub.send_json(self, {"error": "nope"}, status)
      return
    http_stub.send_json(self, {"choices": [{"message": {"role": "assistant", "content": content}}]})

  def log_message(self, *args):
    pass


@pytest.fixture
def server():
  with http_stub.serving(_Handler, requests=[], plan=[]) as srv:
    yield srv


RESPONSES = [f"Approach {i}: use algebra. \\boxed{{{i % 3}}}" for i in range(8)]


def test_prompt_is_the_appendix_prompt_verbatim():
  msgs = dv.judge_messages("Find x.", RESPONSES)
  assert msgs[0] == {"role": "system", "content": dv.JUDGE_SYSTEM_PROMPT}
  assert dv.JUDGE_SYSTEM_PROMPT.startswith(
    "You are evaluating the DIVERSITY of solution approaches")
  user = msgs[1]["content"]
  assert user.startswith("PROBLEM: Find x..\n8 SOLUTION ATTEMPTS: ")
  assert "Response 8:\nApproach 7" in user
  for phrase in ("Score 1 - Minimal Diversity: 14+ responses", "Score 3 - Moderate Diversity: 7-10",
                 "no single approach dominates (<= 3 responses use the same method)",
                 "Return ONLY a number from 1 to 5."):
    assert phrase in user


@pytest.mark.parametrize("text,score", [("4", 4), ("Score: 5", 5), ("I rate this 2/5", 2),
                                        ("3.5", None), ("10", None), ("none", None)])
def test_parse_judge_score(text, score):
  assert dv.parse_judge_score(text) == score


def test_judge_posts_caches_and_retries(server, tmp_path):
  url = f"http://127.0.0.1:{server.server_address[1]}/v1"
  judge = dv.DiversityJudge(url, "gpt-4o-mini", api_key="sk-test", cache_dir=str(tmp_path),
                            retry=dv.Retry(backoff_s=0.01))
  server.plan = [(500, ""), (200, "no idea"), (200, "4")]  # 5xx and unparseable are retried
  assert judge.score("Find x.", RESPONSES) == 4
  assert len(server.requests) == 3
  req = server.requests[-1]
  assert req["path"] == "/v1/chat/completions"
  assert req["auth"] == "Bearer sk-test"
  assert req["body"]["model"] == "gpt-4o-mini"
  assert req["body"]["messages"] == dv.judge_messages("Find x.", RESPONSES)
  # Cached: no new request, even from a new judge object.
  judge2 = dv.DiversityJudge(url + "/chat/completions", "gpt-4o-mini", cache_dir=str(tmp_path))
  assert judge2.score("Find x.", RESPONSES) == 4
  assert judge2.num_requests == 0 and len(server.requests) == 3
  server.plan = [(200, "2")]
  np.testing.assert_array_equal(judge.score_many(["Other."], [RESPONSES]), [2])


def test_judge_client_error_is_not_retried(server):
  url = f"http://127.0.0.1:{server.server_address[1]}"
  judge = dv.DiversityJudge(url, "m", retry=dv.Retry(backoff_s=0.01))
  server.plan = [(401, "")]
  with pytest.raises(dv.JudgeUnavailableError, match="HTTP 401"):
    judge.score("p", RESPONSES)
  assert len(server.requests) == 1


def test_judge_unreachable_gives_a_clear_error():
  port = testing.free_port()  # nothing listens on this port now
  judge = dv.DiversityJudge(f"http://127.0.0.1:{port}/v1", "m",
                            retry=dv.Retry(max_retries=2, backoff_s=0.01, timeout_s=2.0))
  with pytest.raises(dv.JudgeUnavailableError,
                     match=re.escape(f"http://127.0.0.1:{port}/v1/chat/completions") +
                     ".*after 3 attempts"):
    judge.score("p", RESPONSES)
  assert judge.num_requests == 3
  with pytest.raises(ValueError, match="url"):
    dv.DiversityJudge("127.0.0.1:80", "m")


def test_local_metric():
  same = ["Let x = 2, so \\boxed{4}."] * 4
  assert dv.mean_pairwise_distance(same) == pytest.approx(0.0, abs=1e-6)
  assert dv.distinct_answers(same) == 1
  varied = ["Use induction on n. \\boxed{4}",
            "Draw a triangle and apply the law of sines: \\boxed{4.0}",
            "Brute force all cases by computer: \\boxed{5}", "no answer given"]
  d = dv.local_diversity(varied)
  assert d["distinct_answers"] == 3.0  # "4" and "4.0" are different strings; one has none
  assert 0.3 < d["mean_pairwise_distance"] <= 1.0
  # Distances grow with dissimilarity.
  near = ["the cat sat on the mat", "the cat sat on a mat"]
  far = ["the cat sat on the mat", "quantum chromodynamics lattice"]
  assert dv.mean_pairwise_distance(near) < dv.mean_pairwise_distance(far)


def test_distinct_answers_of_pathological_outputs_take_linear_time():
  """Issue 24, finding 4: the local metric parses responses in this process (old: ~100 s each)."""
  pathological = ["\n" * 100_000, "Answer" + "\n" * 100_000,
                  "\\boxed \n" * 12_500 + "Answer: 3", "\n" * 100_000 + "Answer: 2"]
  t0 = time.perf_counter()
  assert dv.distinct_answers(pathological) == 2
  assert time.perf_counter() - t0 < 5.0


def test_local_metric_with_a_pluggable_embedding():
  def onehot_len(texts):
    return np.eye(4)[[len(t) % 4 for t in texts]]
  assert dv.mean_pairwise_distance(["a", "bb", "eeeee"], onehot_len) == pytest.approx(
    np.mean([1.0, 0.0, 1.0]))
  with pytest.raises(ValueError, match="shape"):
    dv.mean_pairwise_distance(["a", "b"], lambda t: np.zeros((3, 2)))
  with pytest.raises(ValueError, match="at least 2"):
    dv.mean_pairwise_distance(["a"])


def test_tfidf_rows_are_unit_norm():
  emb = dv.char_ngram_tfidf(["abcdef", "abcxyz", ""])
  norms = np.linalg.norm(emb, axis=1)
  np.testing.assert_allclose(norms, [1.0, 1.0, 0.0], atol=1e-6)


def test_retry_policy_refuses_bad_values_and_caps_its_delays():
  with pytest.raises(ValueError, match="max_retries must be >= 0, got -1"):
    dv.Retry(max_retries=-1)
  with pytest.raises(ValueError, match="max_backoff_s must be None or >= 0, got -0.5"):
    dv.Retry(max_backoff_s=-0.5)
  assert [dv.Retry(backoff_s=0.5).delay(a) for a in (1, 2, 3, 4)] == [0.5, 1.0, 2.0, 4.0]
  assert [dv.Retry(backoff_s=0.5, max_backoff_s=1.5).delay(a) for a in (1, 2, 3)] == [0.5, 1.0, 1.5]
