"""SamplingParams / Completion validation and serialisation; make_engine argument checks."""

import numpy as np
import pytest

from disa_jax import codec
from disa_jax.rollout import Completion, Engine, SamplingParams, make_engine
from disa_jax.rollout.jax_sampler import JaxSampler
from disa_jax.rollout.sampling import bucket as _bucket


def test_sampling_params_roundtrip_and_validation():
  p = SamplingParams(n=3, temperature=0.5, top_p=0.9, top_k=7, max_tokens=20,
                     stop_token_ids=[2, 5], seed=4, return_raw_logprobs=True)
  assert p.stop_token_ids == (2, 5)
  assert codec.decode(SamplingParams, codec.encode(p), "params") == p
  assert SamplingParams(temperature=0.0).greedy and not p.greedy
  for bad, field in [(dict(n=0), "n"), (dict(top_k=-1), "top_k"), (dict(top_p=1.5), "top_p"),
                     (dict(stop_token_ids=(-1,)), "stop_token_ids"), (dict(seed=1.5), "seed"),
                     (dict(temperature=float("nan")), "temperature")]:
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
      SamplingParams(**bad)


def test_completion_validation():
  c = Completion(token_ids=[1, 2], logprobs=[-0.5, -1.0], raw_logprobs=None, finish_reason="stop")
  assert c.token_ids.dtype == np.int32 and c.logprobs.dtype == np.float32
  with pytest.raises(ValueError, match="finish_reason"):
    Completion(token_ids=[1], logprobs=[0.0], raw_logprobs=None, finish_reason="eos")
  with pytest.raises(ValueError, match="logprobs"):
    Completion(token_ids=[1, 2], logprobs=[0.0], raw_logprobs=None, finish_reason="length")
  with pytest.raises(ValueError, match="raw_logprobs"):
    Completion(token_ids=[1], logprobs=[0.0], raw_logprobs=[0.0, 1.0], finish_reason="length")


def test_buckets_are_powers_of_two():
  assert [_bucket(n, 16) for n in (1, 16, 17, 32, 33)] == [16, 16, 32, 32, 64]
  assert [_bucket(n, 1) for n in (1, 2, 3, 5)] == [1, 2, 4, 8]


def test_make_engine_rejects_unknown_kind(tiny_ckpt):
  with pytest.raises(ValueError, match="kind"):
    make_engine("tpu", tiny_ckpt)
  engine = make_engine("jax", tiny_ckpt, process=None)
  assert isinstance(engine, JaxSampler) and isinstance(engine, Engine)
  engine.close()
  with pytest.raises(RuntimeError, match="closed"):
    engine.generate([[1]], SamplingParams())
