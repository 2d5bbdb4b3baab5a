"""The flat weight push (`disa_jax.rollout.flat_weights`): layout, bitwise round trips, a sharded
export, and a pushed policy sampling as the same weights loaded directly (JAX engine in this
process; the generation process in test_process.py, vLLM in test_vllm_engine.py)."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from disa_jax import codec, models, parallel, testing
from disa_jax.parallel import distributed
from disa_jax.rl.inputs import EngineLink
from disa_jax.rl.update import PolicyUpdater
from disa_jax.rollout import SamplingParams, flat_weights, multihost
from disa_jax.rollout.flat_weights import ALIGN, FlatLayout, FlatWeights
from disa_jax.rollout.jax_sampler import JaxSampler
from tests.rollout import reference

PROMPTS = [[1, 5, 6, 7], [1, 9], [1, 20, 30, 40, 50, 60, 70]]
SMALL_BUCKETS = 100_000  # bytes: the tiny model's parameters in 3-5 buckets


def _bits(a: np.ndarray) -> np.ndarray:
  return np.ascontiguousarray(a).view(np.uint16 if a.dtype.itemsize == 2 else np.uint32)


def _np(dtype):
  return np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)


def test_layout_buckets_and_json_round_trip(tiny_model):
  layout = FlatLayout(tiny_model.config, "bfloat16", SMALL_BUCKETS)
  assert len(layout.bucket_sizes) > 2
  params = flat_weights.model_params(tiny_model)
  assert [e.path for e in layout.entries] == sorted(params)
  for e in layout.entries:
    assert e.offset % ALIGN == 0 and e.offset + e.size <= layout.bucket_sizes[e.bucket]
    assert e.shape == params[e.path].shape
  for b, size in enumerate(layout.bucket_sizes):  # only a parameter alone may exceed the cap
    entries = layout.bucket_entries(b)
    assert len(entries) == 1 or size <= SMALL_BUCKETS // 2 + ALIGN, (b, size, entries)
  assert codec.decode(FlatLayout, codec.encode(layout), "flat") == layout
  assert FlatLayout(tiny_model.config, "float32", 0).bucket_sizes == (
      sum(-(-e.size // ALIGN) * ALIGN for e in layout.entries),)


@pytest.mark.parametrize("assemble,host_memory",
                         [("device", "pageable"), ("device", "pinned"), ("host", "pageable")])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_export_round_trips_bitwise(tiny_model, dtype, assemble, host_memory):
  """Export -> host buckets -> load into another model: every parameter bit for bit the policy's
  cast to the push dtype; the HF-named views equal `to_hf_state_dict`'s arrays bit for bit."""
  flat = flat_weights.export(tiny_model, dtype, bucket_bytes=SMALL_BUCKETS, assemble=assemble,
                             host_memory=host_memory)
  assert len(flat.buffers) > 2 and flat.timings["export_s"] > 0
  want = {p: np.asarray(x).astype(_np(dtype)) for p, x in
          flat_weights.model_params(tiny_model).items()}
  for path, w in want.items():
    np.testing.assert_array_equal(_bits(flat.param(path)), _bits(w))
  hf = models.to_hf_state_dict(tiny_model, dtype=jnp.dtype(dtype))
  assert list(flat) == list(models.expected_hf_keys(tiny_model.config)) and set(flat) == set(hf)
  for name, w in hf.items():
    assert flat[name].shape == w.shape and flat[name].dtype == w.dtype, name
    np.testing.assert_array_equal(_bits(flat[name]), _bits(w), err_msg=name)
  other = testing.make_tiny_model("qwen3", seed=7, head_dim=32, dtype=jnp.dtype(dtype))
  flat_weights.load_into(other, flat)
  for path, x in flat_weights.model_params(other).items():
    np.testing.assert_array_equal(_bits(np.asarray(x)), _bits(want[path]), err_msg=path)


def test_sharded_export_gathers_on_the_devices(tiny_ckpt, tiny_model):
  """A policy sharded over a (fsdp=2, tensor=2) mesh exports the same buckets as on one device."""
  mesh = parallel.make_mesh(fsdp=2, tensor=2, devices=jax.devices()[:4])
  sharded = models.from_pretrained(tiny_ckpt, mesh=mesh)
  assert any(not x.sharding.is_fully_replicated
             for x in flat_weights.model_params(sharded).values())
  want = flat_weights.export(tiny_model, "bfloat16", bucket_bytes=SMALL_BUCKETS, assemble="device")
  for assemble in ("device", "host"):  # the host path: bucket for bucket the same bytes, gaps too
    got = flat_weights.export(sharded, "bfloat16", bucket_bytes=SMALL_BUCKETS, assemble=assemble)
    for g, w in zip(got.buffers, want.buffers, strict=True):
      np.testing.assert_array_equal(_bits(g), _bits(w), err_msg=assemble)


def test_export_assembles_on_the_host_on_cpu_and_refuses_other_modes(tiny_model, monkeypatch):
  calls = []
  host_bucket = flat_weights._host_bucket  # pylint: disable=protected-access
  monkeypatch.setattr(flat_weights, "_host_bucket", lambda *a: calls.append(a) or host_bucket(*a))
  flat_weights.export(tiny_model, "bfloat16", bucket_bytes=SMALL_BUCKETS)  # 'auto' on CPU devices
  assert len(calls) == len(FlatLayout(tiny_model.config, "bfloat16", SMALL_BUCKETS).bucket_sizes)
  with pytest.raises(ValueError, match=r"assemble must be one of .*got 'gpu'"):
    flat_weights.export(tiny_model, "bfloat16", assemble="gpu")
  with pytest.raises(ValueError, match="host_memory must be one of .*'cuda'"):
    flat_weights.export(tiny_model, "bfloat16", host_memory="cuda")


def test_host_memory_auto_pins_on_accelerators_that_offer_it():
  class Mem:
    def __init__(self, kind):
      self.kind = kind

  class Dev:
    def __init__(self, platform, kinds):
      self.platform, self._kinds = platform, kinds

    def addressable_memories(self):
      return [Mem(k) for k in self._kinds]

  resolve = flat_weights.resolve_host_memory
  assert resolve(Dev("gpu", ["device", "pinned_host", "unpinned_host"]), "auto") == "pinned"
  assert resolve(Dev("tpu", ["device", "pinned_host"]), "auto") == "pinned"
  assert resolve(Dev("gpu", ["device"]), "auto") == "pageable"
  assert resolve(Dev("cpu", ["device", "pinned_host"]), "auto") == "pageable"
  assert resolve(jax.devices()[0], "auto") == "pageable"  # this CPU
  assert resolve(Dev("gpu", ["device", "pinned_host"]), "pageable") == "pageable"


def test_pushed_bf16_policy_samples_as_directly_loaded_weights(tiny_model):
  """A float32 policy pushed as bfloat16 into a bfloat16 sampler samples bit for bit what the
  sampler samples after loading the policy's bfloat16 HF state dict; the push recompiles
  nothing."""
  params = SamplingParams(n=2, temperature=0.9, max_tokens=10, seed=3, return_raw_logprobs=True)
  sampler = JaxSampler(testing.make_tiny_model("qwen3", seed=5, head_dim=32, dtype=jnp.bfloat16))
  sampler.update_weights(models.to_hf_state_dict(tiny_model, dtype=jnp.bfloat16))
  want = sampler.generate(PROMPTS, params)
  compiled = {k: f._cache_size() for k, f in sampler._fns.items()}  # pylint: disable=protected-access
  other = testing.make_tiny_model("qwen3", seed=6, head_dim=32)
  sampler.update_weights(flat_weights.export(other, "bfloat16"))
  assert sampler.generate(PROMPTS, params)[0][0].token_ids.tolist() != want[0][0].token_ids.tolist()
  sampler.update_weights(flat_weights.export(tiny_model, "bfloat16", bucket_bytes=SMALL_BUCKETS))
  reference.assert_same_completions(sampler.generate(PROMPTS, params), want)
  assert {k: f._cache_size() for k, f in sampler._fns.items()} == compiled  # pylint: disable=protected-access


def test_bad_pushes_are_named(tiny_model):
  flat = flat_weights.export(tiny_model, "float32", bucket_bytes=SMALL_BUCKETS)
  with pytest.raises(ValueError, match="bucket 1 is float32"):
    FlatWeights(flat.layout, [flat.buffers[0], flat.buffers[1][:-1]] + flat.buffers[2:])
  with pytest.raises(ValueError, match="2 buffers"):
    FlatWeights(flat.layout, flat.buffers[:2])
  deeper = nnx.eval_shape(lambda: models.Transformer(
      testing.tiny_config("qwen3", head_dim=32, num_layers=3), rngs=nnx.Rngs(0)))
  with pytest.raises(ValueError, match="'layers.attn_norm' has shape \\(3, 64\\)"):
    flat_weights.load_into(deeper, flat)
  with pytest.raises(ValueError, match="FlatLayout.dtype"):
    FlatLayout(tiny_model.config, "int8")
  with pytest.raises(KeyError):
    flat["model.layers.9.mlp.up_proj.weight"]  # pylint: disable=pointless-statement


def test_only_host_leaders_copy_and_push(tiny_model, monkeypatch):
  """Every process runs the export (a collective); one that leads no host copies nothing and
  pushes nothing, a host leader without an engine is an error."""
  monkeypatch.setattr(distributed, "is_host_leader", lambda: False)
  assert multihost.host_weights(tiny_model) is None
  multihost.push_weights(tiny_model, None)
  monkeypatch.setattr(distributed, "is_host_leader", lambda: True)
  with pytest.raises(ValueError, match="no generation engine"):
    multihost.push_weights(tiny_model, None)
  assert isinstance(multihost.host_weights(tiny_model), FlatWeights)


def test_the_updaters_push_goes_in_its_bucket_size(tiny_model):
  """The `EngineLink`'s ``push_bucket_bytes`` reaches the export of both of `PolicyUpdater`'s
  pushes (at once, `push`; queued through the pipeline, `queue_push`); a bad value is refused,
  naming it."""

  class Engine:
    update_weights = lambda self, flat: pushed.append(flat)

  class Updater:  # what the pushes use of a `PolicyUpdater`, on the tiny policy
    current_policy = staticmethod(lambda: tiny_model)
    link = EngineLink(Engine(), "float32", SMALL_BUCKETS)

  class Pipeline:
    advance = lambda self, done, flat: pushed.append(flat)

  pushed = []
  PolicyUpdater.push(Updater())
  PolicyUpdater.queue_push(Updater(), Pipeline(), 1)
  want = FlatLayout(tiny_model.config, "float32", SMALL_BUCKETS)
  assert len(want.bucket_sizes) > 2
  assert [p.layout for p in pushed] == [want, want]
  for bad in (-1, 1.5, True):
    with pytest.raises(ValueError,
                       match=f"EngineLink push_bucket_bytes must be an int >= 0 .*got {bad}"):
      EngineLink(None, push_bucket_bytes=bad)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_sampler_in_the_trainers_process_gets_the_flat_pushs_values_without_the_host(
    tiny_model, dtype, monkeypatch):
  """One process, a JAX sampler: `push_weights` copies the policy on the devices
  (`JaxSampler.load_params`), whose parameters equal, bit for bit, those a flat push of the same
  dtype loads (pushed as bfloat16: rounded the same way), in buffers of the sampler's own; an
  engine without ``load_params`` still gets the flat push; a model of another shape is refused,
  naming the parameter."""
  flat_one = JaxSampler(testing.make_tiny_model("qwen3", seed=5, head_dim=32))
  direct = JaxSampler(testing.make_tiny_model("qwen3", seed=5, head_dim=32))
  flat_one.update_weights(flat_weights.export(tiny_model, dtype, bucket_bytes=SMALL_BUCKETS))
  exports, export = [], flat_weights.export
  monkeypatch.setattr(flat_weights, "export", lambda *a, **k: exports.append(1) or export(*a, **k))
  multihost.push_weights(tiny_model, direct, dtype)
  assert not exports  # no flat export, no host copy
  want, got = flat_weights.model_params(flat_one.model), flat_weights.model_params(direct.model)
  assert sorted(got) == sorted(want)
  for path in want:
    np.testing.assert_array_equal(np.asarray(got[path]), np.asarray(want[path]), err_msg=path)
    assert got[path].dtype == jnp.float32
  assert dtype == "float32" or any(  # the bfloat16 push really rounded
      not np.array_equal(np.asarray(got[p]), np.asarray(x))
      for p, x in flat_weights.model_params(tiny_model).items())
  source = flat_weights.model_params(tiny_model)
  assert all(got[p].unsafe_buffer_pointer() != source[p].unsafe_buffer_pointer() for p in got)
  pushed = []

  class Engine:  # no load_params: the flat push
    update_weights = lambda self, flat: pushed.append(flat)

  multihost.push_weights(tiny_model, Engine(), dtype)
  assert len(pushed) == 1 and isinstance(pushed[0], FlatWeights) and exports == [1]
  deeper = testing.make_tiny_model("qwen3", seed=5, head_dim=32, num_layers=3)
  with pytest.raises(ValueError, match="copy_into: parameter 'layers.attn_norm' is \\(2, 64\\) in "
                                       "the source and \\(3, 64\\) in the model"):
    flat_weights.copy_into(deeper, tiny_model)


def test_repeated_pushes_reuse_one_prepared_copy_and_follow_the_source(monkeypatch):
  """`JaxSampler.load_params` prepares the copy once per source and dtype
  (`flat_weights.DeviceCopy`): later pushes walk neither model by path (no `model_params`), and
  still load the source's current values, into the sampler's state and its model; another dtype,
  another source or a flat push in between prepares it again."""
  source = testing.make_tiny_model("qwen3", seed=1, head_dim=32)
  other = testing.make_tiny_model("qwen3", seed=2, head_dim=32)
  sampler = JaxSampler(testing.make_tiny_model("qwen3", seed=5, head_dim=32))
  walks, model_params = [], flat_weights.model_params
  monkeypatch.setattr(flat_weights, "model_params",
                      lambda m: walks.append(1) or model_params(m))

  def pushed_equals(model):
    got = model_params(nnx.merge(sampler._graphdef, sampler._state))  # what generate runs on
    want = model_params(model)
    assert sorted(got) == sorted(want)
    assert all(np.array_equal(np.asarray(got[p]), np.asarray(want[p])) for p in want)
    assert all(np.array_equal(np.asarray(x), np.asarray(got[p]))
               for p, x in model_params(sampler.model).items())

  sampler.load_params(source)
  first = len(walks)
  assert first == 2  # prepared: the two models walked once
  pushed_equals(source)
  nnx.update(source, jax.tree.map(lambda x: x + 1.0, nnx.state(source, nnx.Param)))
  sampler.load_params(source)
  assert len(walks) == first  # no walk by path
  pushed_equals(source)  # the source's new values
  sampler.load_params(other)
  pushed_equals(other)
  assert len(walks) == first + 2  # another source: prepared again
  sampler.load_params(other, "bfloat16")
  assert len(walks) == first + 4
  sampler.update_weights(flat_weights.export(source, "float32", bucket_bytes=SMALL_BUCKETS))
  walks.clear()
  sampler.load_params(other, "bfloat16")
  assert len(walks) == 2  # a flat push in between: the placements read again


def test_a_push_on_the_devices_does_not_compile_generate_again():
  """The sampler's starting weights are committed like the pushed ones, so the generate program
  compiled before the first `load_params` serves after it (it compiled twice per process)."""
  sampler = JaxSampler(testing.make_tiny_model("qwen3", seed=5, head_dim=32), max_batch_size=8)
  params = SamplingParams(n=2, max_tokens=4, seed=0)
  sampler.generate([[1, 2, 3]], params)
  sampler.load_params(testing.make_tiny_model("qwen3", seed=1, head_dim=32))
  sampler.generate([[1, 2, 3]], params)
  assert [fn._cache_size() for fn in sampler._fns.values()] == [1]
