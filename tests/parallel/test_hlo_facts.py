"""`parallel.hlo_facts` on a hand-written optimized module: loop bodies are counted per trip, a loop
without a static trip count is named, buffers inside fusion bodies are not buffers."""
from disa_jax.parallel import hlo_facts

MODULE = """\
HloModule jit_step

%fused_dot (p0: bf16[64,32], p1: bf16[32,16]) -> bf16[64,16] {
  %p0 = bf16[64,32]{1,0} parameter(0)
  %p1 = bf16[32,16]{1,0} parameter(1)
  %scores = f32[4096,4096]{1,0} broadcast(%p0), dimensions={}
  ROOT %dot.1 = bf16[64,16]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%body (t: (s32[], bf16[64,32])) -> (s32[], bf16[64,32]) {
  %t = (s32[], bf16[64,32]{1,0}) parameter(0)
  %x = bf16[64,32]{1,0} get-tuple-element(%t), index=1
  %w = bf16[32,16]{1,0} constant({...})
  %ag = bf16[256,32]{1,0} all-gather-start(%x), dimensions={0}
  %f = bf16[64,16]{1,0} fusion(%x, %w), kind=kCustom, calls=%fused_dot, backend_config={"fusion_backend_config":{"kind":"__triton_nested_gemm_fusion"}}
  %attn = (bf16[2,8,4,64]{3,2,1,0}, f32[2,4,8]{2,1,0}, u8[0]{0}) custom-call(%x, %lens, %offs), custom_call_target="__cudnn$fmhaSoftmax"
  %lens = s32[2,16]{1,0} constant({...})
  %offs = s32[2,17]{1,0} constant({...})
  ROOT %r = (s32[], bf16[64,32]{1,0}) tuple(%i, %x)
}

%cond (t: (s32[], bf16[64,32])) -> pred[] {
  %t = (s32[], bf16[64,32]{1,0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (a: bf16[64,32]) -> bf16[64,32] {
  %a = bf16[64,32]{1,0} parameter(0)
  %init = (s32[], bf16[64,32]{1,0}) tuple(%z, %a)
  %while.1 = (s32[], bf16[64,32]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"36"}}
  %while.2 = (s32[], bf16[64,32]{1,0}) while(%init), condition=%cond, body=%body, backend_config={}
  ROOT %out = bf16[64,32]{1,0} get-tuple-element(%while.1), index=1
}
"""


def test_loop_bodies_count_per_trip_and_unknown_trips_are_named():
  f = hlo_facts.read_module(MODULE)
  per_trip = 2 * 64 * 16 * 32
  assert f.dot_flops == (36 + 1) * per_trip  # the counted loop x 36, the other once
  assert f.kernel_fusions == {"__triton_nested_gemm_fusion": 37}
  assert f.custom_calls == {"__cudnn$fmhaSoftmax": 37}
  assert f.collectives == {"all-gather": {"count": 37, "bytes": 37 * 256 * 32 * 2}}
  assert [(w.name, w.trip_count) for w in f.data_dependent_loops] == [("while.2", None)]
  assert f.cudnn_segment_slots == (16,)


def test_fusion_bodies_are_not_buffers():
  f = hlo_facts.read_module(MODULE)
  assert "f32[4096,4096]" not in [b.shape for b in f.largest]  # inside %fused_dot
  assert f.largest[0].shape == "bf16[256,32]"
