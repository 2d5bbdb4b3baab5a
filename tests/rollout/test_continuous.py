"""The ragged KV cache and continuous batching (`disa_jax.rollout.continuous`): the same samples as
the dense reference path, decode attention over the live entries only (the XLA reference and the
Pallas kernel, in the interpreter here), one in-place cache, and the memory of 256 rows of a 4B
model."""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from disa_jax import models
from disa_jax.models import attention as A
from disa_jax.models.decode_attention import CPU_STATIC_BLOCKS, ragged_attention, resolve
from disa_jax.models.kv_bits import as_bits, from_bits
from disa_jax.models.decode_attention_pallas import pallas_ragged_attention
from disa_jax.rollout import SamplingParams, continuous
from disa_jax.rollout.jax_sampler import JaxSampler
from tests.rollout import reference

PROMPTS = [[1, 5, 6, 7], [1, 9], [1, 20, 30, 40, 50, 60, 70], [3, 4], [8, 9, 10, 11, 12]]
H200_BYTES = 139 << 30  # the H200's usable memory (about 139 GiB)


@pytest.fixture(scope="module")
def samplers(tiny_model):
  """The ragged sampler and the dense reference on the same weights; few slots, so that 5 prompts
  x 4 samples wait for each other."""
  kw = dict(max_batch_size=8, min_batch_bucket=8, decode_block=16)
  return (JaxSampler(tiny_model, cache_layout="ragged", **kw),
          JaxSampler(tiny_model, cache_layout="dense", **kw))


@pytest.mark.parametrize("params", [
    SamplingParams(n=4, temperature=0.0, max_tokens=20, return_raw_logprobs=True),
    SamplingParams(n=4, temperature=1.0, max_tokens=20, seed=3, return_raw_logprobs=True),
    SamplingParams(n=4, temperature=0.8, top_k=20, top_p=0.9, max_tokens=20, seed=5),
], ids=["greedy", "sampled", "truncated"])
def test_ragged_samples_what_the_dense_reference_samples(samplers, params):
  """Greedy and under a fixed key: the same tokens, log-probs equal to float32 rounding (the
  blocked online softmax sums in another order than one softmax). The parameters share one
  compiled program per path (same shapes)."""
  ragged, dense = samplers
  reference.assert_same_completions(ragged.generate(PROMPTS, params),
                                    dense.generate(PROMPTS, params), atol=1e-5)


def test_auto_runs_a_request_that_fits_on_the_dense_path_and_a_larger_one_ragged(samplers,
                                                                               tiny_model):
  """'auto' (the default): 8 rows on 8 slots of a 48-position cache (nothing waits, one
  decode_block) take the dense program and sample its bits; 20 rows, or a cache longer than
  decode_block, take the ragged program and sample the ragged path's bits."""
  ragged, dense = samplers
  auto = JaxSampler(tiny_model, max_batch_size=8, min_batch_bucket=8, decode_block=64)
  assert auto.cache_layout == "auto"
  params = SamplingParams(n=4, temperature=1.0, max_tokens=20, seed=3, return_raw_logprobs=True)
  # (prompts of 7 tokens -> 16 positions, 20 new -> 32: a cache of 48)
  assert [auto.layout_of(r, 7, 20) for r in (1, 8, 9, 20)] == ["dense", "dense", "ragged", "ragged"]
  assert [auto.layout_of(8, p, t) for p, t in ((32, 32), (33, 20), (7, 33))] == [
      "dense", "ragged", "ragged"]  # 32 + 32 positions fit; 64 + 32 and 16 + 64 do not
  for prompts, want in ((PROMPTS[:2], dense), (PROMPTS, ragged)):
    got = auto.generate(prompts, params)
    reference.assert_same_completions(got, want.generate(prompts, params), atol=0.0)
  assert sorted(key[0] for key in auto._fns) == ["dense", "ragged"]
  with pytest.raises(ValueError, match=r"2 x 4 rows.*dense path.*cache_layout='ragged'"):
    auto.lower_programs(2, 4, 7, 20)  # (the ragged programs of a request that runs dense)


def test_the_static_and_live_bounds_loops_sample_the_same_bits(tiny_model):
  """Decode attention 'xla' (every cache block, dead ones masked) and 'xla_live' (the live blocks
  only) give the same tokens and log-probs bit for bit (the dead blocks add exactly 0), so 'auto'
  may pick either; it takes the static loop on a CPU for a cache of few blocks."""
  got = {}
  for impl in ("xla", "xla_live"):
    model = nnx.clone(tiny_model)
    model.options = dataclasses.replace(model.options, decode_attention=impl)
    sampler = JaxSampler(model, cache_layout="ragged", max_batch_size=8, min_batch_bucket=8,
                         decode_block=4)
    got[impl] = sampler.generate(PROMPTS, SamplingParams(n=4, temperature=1.0, max_tokens=20,
                                                         seed=3, return_raw_logprobs=True))
  for a, b in zip(got["xla"], got["xla_live"]):
    for x, y in zip(a, b):
      assert list(x.token_ids) == list(y.token_ids)
      np.testing.assert_array_equal(np.asarray(x.raw_logprobs), np.asarray(y.raw_logprobs))
  assert resolve("auto", "cpu", CPU_STATIC_BLOCKS) == "xla"
  assert resolve("auto", "cpu", CPU_STATIC_BLOCKS + 1) == resolve("auto", "cpu") == "xla_live"
  assert resolve("auto", "gpu", 1000) == "xla" and resolve("pallas", "cpu", 2) == "pallas"


def test_finished_rows_free_their_slots_for_waiting_rows(samplers):
  """20 rows on 8 slots; rows stop at different lengths (stop = each prompt's 2nd-7th greedy
  token), so later rows start in slots freed early: fewer decode steps than the dense path's
  chunks of 8 run, and the same completions."""
  ragged, dense = samplers
  greedy = dense.generate(PROMPTS, SamplingParams(n=4, temperature=0.0, max_tokens=20))
  stops = tuple({int(g[0].token_ids[i]) for i, g in zip((1, 3, 6, 2, 4), greedy)})
  params = SamplingParams(n=4, temperature=1.0, max_tokens=20, seed=9, stop_token_ids=stops)
  got, want = ragged.generate(PROMPTS, params), dense.generate(PROMPTS, params)
  reference.assert_same_completions(got, want, atol=1e-5)
  lengths = [len(c.token_ids) for per in want for c in per]
  assert len(set(lengths)) > 3 and min(lengths) < 20, lengths
  # Decode steps (each row's first token comes from its prefill): chunks of 8 run to their
  # longest row; continuous batching refills freed slots while the long rows run.
  chunked = sum(max(lengths[i:i + 8]) - 1 for i in range(0, len(lengths), 8))
  assert ragged.last_num_steps - 1 < chunked, (ragged.last_num_steps - 1, chunked, lengths)


ATTEND = {"xla_live": functools.partial(ragged_attention, live_bounds=True),
          "pallas": pallas_ragged_attention}


@pytest.mark.parametrize("impl", ["xla_live", "pallas"])
def test_decode_attention_reads_live_blocks_only(impl):
  """Against a dense masked softmax: every slot sees exactly its live range; the blocks outside
  [min start, max end) hold NaN and are never read (the output stays finite). 'pallas' is the
  kernel in the Pallas interpreter, its layer a traced value in one case."""
  rng = np.random.default_rng(0)
  layers, b, kv, g, s, h, block = 2, 4, 2, 3, 64, 8, 8
  k = rng.normal(size=(layers, b, kv, s, h)).astype(np.float32)
  v = rng.normal(size=(layers, b, kv, s, h)).astype(np.float32)
  q = rng.normal(size=(b, 1, kv * g, h)).astype(np.float32)
  start, write = np.array([9, 17, 20, 12]), np.array([29, 39, 20, 32])
  k_new, v_new = (rng.normal(size=(b, kv, h)).astype(np.float32) for _ in range(2))
  for x in (k, v):
    x[:, :, :, :8] = np.nan  # block 0: before every start's block
    x[:, :, :, 40:] = np.nan  # blocks 5-7: after every write
  for layer in (0, jnp.int32(1)):
    out, kc, vc = ATTEND[impl](jnp.asarray(q), jnp.asarray(k_new), jnp.asarray(v_new),
                               as_bits(jnp.asarray(k)), as_bits(jnp.asarray(v)), layer,
                               jnp.asarray(write), jnp.asarray(start), block, "float32")
    layer = int(layer)
    kc, vc = from_bits(kc, jnp.float32), from_bits(vc, jnp.float32)
    want_k, want_v = k.copy(), v.copy()
    want_k[layer, np.arange(b), :, write], want_v[layer, np.arange(b), :, write] = k_new, v_new
    np.testing.assert_array_equal(np.asarray(kc), want_k)
    np.testing.assert_array_equal(np.asarray(vc), want_v)
    live = (np.arange(s)[None] >= start[:, None]) & (np.arange(s)[None] <= write[:, None])
    kt, vt = (np.nan_to_num(x[layer]).transpose(0, 2, 1, 3) for x in (want_k, want_v))
    want = np.asarray(A.gqa_attention(jnp.asarray(q), jnp.asarray(kt), jnp.asarray(vt),
                                      jnp.asarray(live[:, None, :])))  # kt: [B, S, K, H]
    np.testing.assert_allclose(np.asarray(out), want, atol=2e-6)


def test_the_pallas_kernel_reads_each_slots_own_blocks_only():
  """Every block outside a slot's own live blocks holds NaN in that slot: the kernel (a program
  per slot and head) never reads them, and matches a dense softmax over the live range; the XLA
  reference, whose loop spans every slot's live blocks, reads them (NaN)."""
  rng = np.random.default_rng(1)
  b, kv, g, s, h, block = 3, 2, 2, 64, 8, 8
  k = rng.normal(size=(1, b, kv, s, h)).astype(np.float32)
  v = rng.normal(size=(1, b, kv, s, h)).astype(np.float32)
  q = rng.normal(size=(b, 1, kv * g, h)).astype(np.float32)
  start, write = np.array([0, 24, 50]), np.array([9, 30, 63])
  new = [rng.normal(size=(b, kv, h)).astype(np.float32) for _ in range(2)]
  for row in range(b):
    own = np.zeros(s, bool)
    own[start[row] // block * block:(write[row] // block + 1) * block] = True
    k[0, row, :, ~own] = np.nan
    v[0, row, :, ~own] = np.nan
  args = [jnp.asarray(x) for x in (q, *new)] + [as_bits(jnp.asarray(k)), as_bits(jnp.asarray(v))]
  out = pallas_ragged_attention(*args, 0, jnp.asarray(write), jnp.asarray(start), block,
                                "float32")[0]
  k[0, np.arange(b), :, write], v[0, np.arange(b), :, write] = new
  live = (np.arange(s)[None] >= start[:, None]) & (np.arange(s)[None] <= write[:, None])
  kt, vt = (np.nan_to_num(x[0]).transpose(0, 2, 1, 3) for x in (k, v))
  want = A.gqa_attention(jnp.asarray(q), jnp.asarray(kt), jnp.asarray(vt),
                         jnp.asarray(live[:, None, :]))
  np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=2e-6)
  ref = ragged_attention(*args, 0, jnp.asarray(write), jnp.asarray(start), block, "float32",
                         live_bounds=True)[0]
  assert np.isnan(np.asarray(ref)).any()


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_every_block_loop_gives_what_the_live_loop_gives(impl):
  """'xla' loops over every block of the cache (a static trip count) and 'pallas' takes its
  layer as a traced operand under a scan over the layers: with finite garbage outside the live
  ranges, both give what the live-bounds loop gives, for every layer: 'xla' bit for bit, 'pallas'
  to float32 rounding (its sums run in another order); the caches bit for bit."""
  rng = np.random.default_rng(2)
  layers, b, kv, g, s, h, block = 3, 4, 2, 2, 64, 8, 8
  k, v = (as_bits(jnp.asarray(rng.normal(size=(layers, b, kv, s, h)) * 1e3, jnp.float32))
          for _ in range(2))
  q = jnp.asarray(rng.normal(size=(layers, b, 1, kv * g, h)), jnp.float32)
  new = [jnp.asarray(rng.normal(size=(layers, b, kv, h)), jnp.float32) for _ in range(2)]
  start, write = jnp.asarray([9, 17, 20, 12]), jnp.asarray([29, 39, 20, 32])
  attend = functools.partial(ATTEND.get(impl, ragged_attention), write=write, start=start,
                             block=block, dtype="float32")

  def scanned(step, caches):
    def body(c, xs):
      q_l, k_l, v_l, layer = xs
      out, kc, vc = step(q_l, k_l, v_l, c[0], c[1], layer)
      return (kc, vc), out
    return jax.lax.scan(body, caches, (q, *new, jnp.arange(layers)))

  live = functools.partial(ragged_attention, live_bounds=True, write=write, start=start,
                           block=block, dtype="float32")
  got = jax.jit(functools.partial(scanned, lambda *a: attend(*a[:5], layer=a[5])))((k, v))
  want = jax.jit(functools.partial(scanned, lambda *a: live(*a[:5], layer=a[5])))((k, v))
  for x, y in zip(jax.tree.leaves(got[0]), jax.tree.leaves(want[0])):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]),
                             rtol=0 if impl == "xla" else 1e-5)


@pytest.mark.slow  # the sampler's program with the kernel in the interpreter: ~9 s per case
@pytest.mark.parametrize("params", [
    SamplingParams(n=4, temperature=0.0, max_tokens=12, return_raw_logprobs=True),
    SamplingParams(n=4, temperature=1.0, max_tokens=12, seed=3, return_raw_logprobs=True),
], ids=["greedy", "sampled"])
def test_the_pallas_decode_samples_what_the_xla_decode_samples(tiny_model, params):
  """The same weights with ``ModelOptions(decode_attention='pallas')`` (the kernel in the
  interpreter, the layers unrolled) against the XLA reference: the same tokens, log-probs equal
  to float32 rounding."""
  pallas = models.Transformer(tiny_model.config, rngs=nnx.Rngs(1),
                              options=models.ModelOptions(decode_attention="pallas"))
  nnx.update(pallas, nnx.state(tiny_model))
  kw = dict(max_batch_size=8, min_batch_bucket=8, decode_block=16)
  got = JaxSampler(pallas, **kw).generate(PROMPTS, params)
  want = JaxSampler(tiny_model, **kw).generate(PROMPTS, params)
  reference.assert_same_completions(got, want, atol=1e-5)


def test_the_engine_options_reach_the_models_decode_attention(tiny_ckpt):
  """``engine.jax_kwargs`` holds sampler and model options: `JaxSampler.from_pretrained` passes
  the `ModelOptions` fields to the model, the rest to the sampler; a bad value is named."""
  path = tiny_ckpt
  sampler = JaxSampler.from_pretrained(path, decode_attention="pallas", decode_block=16)
  assert sampler.model.options.decode_attention == "pallas" and sampler.decode_block == 16
  with pytest.raises(ValueError, match="decode_attention must be one of .*'flash'"):
    JaxSampler.from_pretrained(path, decode_attention="flash")


def test_one_cache_updated_in_place(tiny_model):
  """The compiled ragged program holds one KV cache: the donated input, aliased to the output;
  everything else it allocates is < 10% of the cache's size."""
  sampler = JaxSampler(tiny_model, max_batch_size=64)
  memory, cache = sampler.compiled_memory(prompts=8, n=8, prompt_len=16, max_tokens=512)
  assert cache == continuous.cache_bytes(tiny_model.config, 64, 16 + 512, jnp.float32)
  assert memory.alias_size_in_bytes >= cache
  assert memory.temp_size_in_bytes <= 0.1 * cache, (memory.temp_size_in_bytes, cache)


def test_a_float32_cache_is_read_without_bit_conversions(tiny_model):
  """A float32 cache is stored as float32 (XLA:CPU scatters it in place): the compiled decode
  program has no bitcast-convert (each one materialised a copy of the cache block it read:
  ~4.2 ms of the bench request's 18.2 ms, benchmarks/results/stage3_vs_trl_cpu_issue64_t64c.txt);
  a bfloat16 cache is still stored as its uint16 bits, and the round trip is exact."""
  sampler = JaxSampler(tiny_model, max_batch_size=64, cache_layout="ragged")
  hlo = sampler.lower_programs(8, 8, 24, 8, programs=("generate",))["generate"].compile().as_text()
  converts = [l for l in hlo.splitlines()
              if "bitcast_convert" in l.replace("-", "_") and "attention/" in l]
  assert not converts, converts[0][:300]  # (the sampler's uniform draws keep theirs)
  assert continuous.empty_cache(tiny_model.config, 2, 16, jnp.float32)["k"].dtype == jnp.float32
  assert continuous.empty_cache(tiny_model.config, 2, 16, jnp.bfloat16)["k"].dtype == jnp.uint16
  x = jnp.asarray(np.random.default_rng(0).normal(size=(64,)), jnp.bfloat16)
  assert as_bits(x).dtype == jnp.uint16 and (from_bits(as_bits(x), jnp.bfloat16) == x).all()


@pytest.mark.slow  # compiles a 36-layer (scanned) 4B program on the CPU: ~25 s
def test_256_rows_of_a_4b_model_fit_one_h200():
  """qwen3-4b-base, 32 prompts of 256 tokens x 8 samples x 1,024 new tokens on 256 slots: the
  bfloat16 cache is 256 x 1,280 x 36 x 2 x 8 x 128 x 2 bytes = 45 GiB (one copy), and bfloat16
  weights + cache + the program's temporaries fit the H200's 139 GiB.

  The program is compiled in float32: XLA:CPU would convert every bfloat16 weight to float32
  (~35 GB of temporaries no GPU has); the float32 program's temporaries bound the bfloat16 one's.
  """
  config = models.get_preset("qwen3-4b-base")
  model = nnx.eval_shape(lambda: models.Transformer(
      config, rngs=nnx.Rngs(0), options=models.ModelOptions(layer_loop="scan")))
  sampler = JaxSampler(model, max_batch_size=256)
  memory, cache32 = sampler.compiled_memory(prompts=32, n=8, prompt_len=256, max_tokens=1024)
  cache = continuous.cache_bytes(config, 256, 256 + 1024, jnp.bfloat16)
  assert cache == 256 * 1280 * 36 * 2 * 8 * 128 * 2 == cache32 // 2 == 48_318_382_080
  assert memory.alias_size_in_bytes >= cache32  # the float32 cache, donated: one copy
  assert memory.temp_size_in_bytes <= 0.1 * cache32, memory
  weights = sum(math.prod(x.shape) * 2 for x in jax.tree.leaves(nnx.state(model)))
  assert weights == 8_044_936_192
  assert weights + cache + memory.temp_size_in_bytes < H200_BYTES, memory


def test_admission_rows():
  assert [continuous.admission_rows(s, n) for s, n in
          [(8, 1), (64, 8), (256, 8), (256, 1024), (64, 12), (16, 4), (8, 12)]] == [
              1, 8, 32, 32, 12, 4, 1]


def test_bad_sampler_options_are_named(tiny_model):
  with pytest.raises(ValueError, match="cache_layout"):
    JaxSampler(tiny_model, cache_layout="paged")
  with pytest.raises(ValueError, match="decode_block"):
    JaxSampler(tiny_model, decode_block=24)
  with pytest.raises(ValueError, match="decode_attention must be one of .*'flash'"):
    models.ModelOptions(decode_attention="flash")
