"""The fused implementations' CPU-checkable parts: cuDNN's packed-layout arguments and its
grouped-query bug probe (the kernel itself needs a GPU: a stand-in that computes attention from
those arguments checks what is passed), repeating K/V heads, the implementation choice, and the
kernels under `jax.shard_map` on a mesh."""

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from disa_jax import parallel
from disa_jax.models import attention, attention_cudnn, attention_dispatch, attention_splash

from .attention_cases import (CASES, REL_TOL, layout, max_rel_err, packed_ids, qkv, reference,
                              reference_value_and_grads, value_and_grads)

_CUDNN = attention_cudnn._cudnn  # pylint: disable=protected-access  (JAX's cuDNN module)
_packed_segments = jax.jit(lambda lay, m: attention_cudnn.packed_segments(lay, m), static_argnums=1)


def test_packed_segments_describe_the_runs():
  seg = packed_ids()
  lengths, offsets, fits = _packed_segments(layout(seg), 4)
  np.testing.assert_array_equal(lengths, [[7, 5, 9, -1], [20, -1, -1, -1]])
  np.testing.assert_array_equal(offsets, [[0, 7, 12, -1, -1], [0, -1, -1, -1, -1]])
  assert fits.tolist() == [True, True]
  _, _, fits = _packed_segments(layout(seg), 2)
  assert fits.tolist() == [False, True]  # row 0 has 3 segments
  odd = np.array([[1, 1, 2, 1, 0, 0], [0, 0, 3, 3, 5, 5]], np.int32)  # id 1 comes back in row 0
  lengths, offsets, fits = _packed_segments(layout(odd), 3)
  assert fits.tolist() == [False, True]
  np.testing.assert_array_equal(lengths[1], [2, 2, -1])  # padding first: runs start at 2 and 4
  np.testing.assert_array_equal(offsets[1], [2, 4, -1, -1])


def _fixed_offsets(q_seqlen, kv_seqlen, q_offsets, kv_offsets, query, key):
  """JAX's conversion with the key stride of jax-ml/jax#39521 (K x H)."""
  b, t, n, h = query.shape
  _, s, kv_heads, _ = key.shape
  cu = lambda o, m: jnp.where(o >= 0, o + (jnp.arange(b) * m)[:, None], o)
  return q_seqlen, kv_seqlen, cu(q_offsets, t) * n * h, cu(kv_offsets, s) * kv_heads * h


def test_the_grouped_query_offset_probe(monkeypatch):
  """JAX 0.10.2 scales the key offsets by the query heads (the bug): the probe says so, and says
  the opposite for a conversion with the fix."""
  attention_cudnn.kv_offsets_use_kv_heads.cache_clear()
  assert attention_cudnn.cudnn_available()
  seen = []  # first asked while a model is being traced: still a host-side answer
  jax.jit(lambda x: seen.append(attention_cudnn.kv_offsets_use_kv_heads()) or x)(1.0)
  if jax.__version__ == "0.10.2":
    assert seen == [False]
  monkeypatch.setattr(_CUDNN, "_fix_seqlen_offsets", _fixed_offsets)
  attention_cudnn.kv_offsets_use_kv_heads.cache_clear()
  assert attention_cudnn.kv_offsets_use_kv_heads()
  attention_cudnn.kv_offsets_use_kv_heads.cache_clear()


def test_repeating_kv_heads_is_the_same_attention():
  seg, _ = CASES["packed"]()
  lay = layout(seg)
  q, k, v, w = qkv(seed=4)
  gqa = reference_value_and_grads(lay, q, k, v, w)
  mha = jax.jit(lambda *a: value_and_grads(
      lambda q, k, v: reference(q, *attention_cudnn.repeat_kv(k, v, 4), lay), *a))(q, k, v, w)
  assert max_rel_err(mha, gqa) <= REL_TOL


def _stand_in(calls):
  """A CPU stand-in for cuDNN's packed attention: the segments are rebuilt from the offsets and
  lengths it is given (garbage on tokens outside every segment, as cuDNN leaves them)."""
  def fake(q, k, v, *, q_seqlen, kv_seqlen, q_offsets, kv_offsets, scale, mask_type, qkv_layout):
    calls.append(dict(kv_heads=k.shape[2], mask_type=mask_type, layout=qkv_layout))
    assert (q_seqlen is kv_seqlen) and (q_offsets is kv_offsets)
    assert scale == pytest.approx(q.shape[-1] ** -0.5)
    t = q.shape[1]
    idx = jnp.arange(t)
    starts, lengths = q_offsets[:, :-1, None], q_seqlen[:, :, None]
    inside = (starts >= 0) & (idx >= starts) & (idx < starts + lengths)  # [B, M, T]
    seg = jnp.max(jnp.where(inside, jnp.arange(1, inside.shape[1] + 1)[None, :, None], 0), 1)
    out = reference(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
                    attention.packed_layout(seg))
    return jnp.where((seg > 0)[:, :, None, None], out, jnp.nan).astype(q.dtype)
  return fake


def test_cudnn_wrapper_passes_the_packed_layout(monkeypatch):
  """The wrapper's arguments, read back by the stand-in, give the reference attention; without
  the offset fix the K heads are repeated to N; padding rows are zeroed; a row with more segments
  than ``max_segments`` is NaN."""
  calls = []
  monkeypatch.setattr(_CUDNN, "dot_product_attention", _stand_in(calls))
  seg = packed_ids()
  lay = layout(seg)
  q, k, v, _ = (x.astype(jnp.bfloat16) for x in qkv(seed=5))
  run = lambda m: jax.jit(lambda *a: attention_cudnn.cudnn_attention(*a, max_segments=m))
  out = run(4)(q, k, v, lay)
  want = reference(*(x.astype(jnp.float32) for x in (q, k, v)), lay)
  assert max_rel_err(out, want) <= 1e-2  # bfloat16 output
  assert np.all(np.asarray(out)[seg == 0] == 0)
  assert calls[-1]["kv_heads"] == q.shape[2] and calls[-1]["layout"] == "BTNH"
  assert calls[-1]["mask_type"] == _CUDNN.MaskType.PADDING_CAUSAL
  monkeypatch.setattr(attention_cudnn, "kv_offsets_use_kv_heads", lambda: True)
  run(4)(q, k, v, lay)
  assert calls[-1]["kv_heads"] == k.shape[2]  # fixed JAX: no repeat
  out = np.asarray(run(2)(q, k, v, lay))
  assert np.isnan(out[0]).all() and np.isfinite(out[1]).all()
  with pytest.raises(ValueError, match="cannot run this call: dtype float32"):
    attention_cudnn.cudnn_attention(*qkv()[:3], lay, max_segments=4)
  with pytest.raises(ValueError, match="needs Transformer max_segments >= 1 .* got 0"):
    run(0)(q, k, v, lay)  # 0 was one slot per token (issue 66's 8 TiB request)


def test_implementation_choice():
  pick = lambda impl, backend, dtype=jnp.bfloat16, h=128, branches=False: (
      attention_dispatch.resolve_impl(impl, backend=backend, dtype=dtype, head_dim=h,
                                      branches=branches))
  assert [pick("auto", b) for b in ("cpu", "gpu", "tpu")] == ["xla", "cudnn", "splash"]
  assert pick("auto", "gpu", dtype=jnp.float32) == "xla"  # cuDNN flash: bf16 / fp16 only
  assert pick("auto", "gpu", h=256) == "xla"
  gpu = lambda cap: attention_dispatch.resolve_impl("auto", backend="gpu", dtype=jnp.bfloat16,
                                                   head_dim=128, branches=False, capability=cap)
  assert (gpu("8.0"), gpu("9.0")) == ("xla", "cudnn")  # packed cuDNN: Hopper on (not the A100)
  assert pick("cudnn", "gpu", branches=True) == "xla"  # shared prompts: not a cuDNN mask
  assert pick("auto", "tpu", branches=True) == "xla"
  assert [pick(i, "cpu") for i in ("dense", "xla", "pallas")] == ["dense", "xla", "pallas"]
  with pytest.raises(ValueError, match=r"attention_impl='cudnn' runs on \('gpu',\) only.*'cpu'"):
    pick("cudnn", "cpu")
  with pytest.raises(ValueError, match=r"attention_impl='pallas' runs on \('gpu', 'cpu'\) only"):
    pick("pallas", "tpu")  # the kernels are written for Triton
  with pytest.raises(ValueError, match="attention_impl must be one of .* got 'flash'"):
    pick("flash", "gpu")


def test_kernels_run_per_device_on_a_mesh(n_devices):
  """The Pallas kernels under `jax.shard_map`: the batch over fsdp = 2 and the heads over
  tensor = 2 give the single-device values and gradients."""
  assert n_devices >= 4
  mesh = Mesh(np.asarray(jax.devices()[:4]).reshape(1, 2, 2), ("data", "fsdp", "tensor"))
  ctx = parallel.ShardingContext(mesh, parallel.TRAIN_RULES)
  seg, br = CASES["branches"]()
  lay = layout(seg, br)
  q, k, v, w = qkv(seed=6)
  run = lambda sharding: lambda q, k, v: attention_dispatch.attend(q, k, v, lay, impl="pallas",
                                                                    sharding=sharding)
  specs = attention_dispatch._mesh_specs(ctx, q, k)  # pylint: disable=protected-access
  assert specs[0] == jax.sharding.PartitionSpec(("data", "fsdp"), None, "tensor", None)
  got = jax.jit(lambda *a: value_and_grads(run(ctx), *a))(q, k, v, w)
  want = jax.jit(lambda *a: value_and_grads(run(None), *a))(q, k, v, w)
  assert max_rel_err(got, want) <= REL_TOL


def test_splash_runs_in_the_interpreter_and_equals_the_reference():
  """JAX's splash attention (the TPU choice) with the rows' segment ids, interpreted on the CPU:
  4 query heads over 1 key/value head, head_dim 128 (a TPU lane), 2 segments and 26 padding tokens
  in 256, 128-token blocks."""
  seg = np.zeros((1, 256), np.int32)
  seg[0, :100], seg[0, 100:230] = 1, 2
  lay = layout(seg)
  q, k, v, w = (x[:1] for x in qkv(seed=9, t=256, n=4, kv=1, h=128))
  splash = lambda q, k, v: attention_splash.splash_attention(q, k, v, lay, block=128,
                                                             interpret=True)
  got = jax.jit(lambda *a: value_and_grads(splash, *a))(q, k, v, w)
  assert max_rel_err(got, reference_value_and_grads(lay, q, k, v, w)) <= REL_TOL
