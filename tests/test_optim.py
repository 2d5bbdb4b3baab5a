"""The one optimizer builder, the one accumulate-and-apply step and the one layout builder
(`disa_jax.optim`, `disa_jax.data.packing.micro_batch_layout`), shared by Stage 3, LoRA-SFT and the
main job's warm-up."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from disa_jax import optim
from disa_jax.data import packing
from disa_jax.sft import SupervisedSchedule, make_sft_step
from disa_jax.sft.supervised import batch_loss
from disa_jax.testing import make_tiny_model


def test_make_optimizer_takes_a_schedule_or_a_peak_rate():
  params = {"w": jnp.ones(3)}
  grads = {"w": jnp.asarray([1.0, -2.0, 0.5])}
  sched = optax.linear_schedule(0.0, 1e-2, 4)
  got = optim.make_optimizer(sched, weight_decay=0.0, grad_clip=1.0)
  want = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, weight_decay=0.0))
  a, b = got.init(params), want.init(params)
  for _ in range(3):
    ua, a = got.update(grads, a, params)
    ub, b = want.update(grads, b, params)
    np.testing.assert_array_equal(ua["w"], ub["w"])
  with pytest.raises(ValueError, match="lr is a schedule: warmup_steps and decay_frac must be 0, "
                                       "got 5, 0.0"):
    optim.make_optimizer(sched, warmup_steps=5)
  # grad_clip <= 0: the bare AdamW (the state of Stage 3's checkpoints without a clip)
  assert jax.tree.structure(optim.make_optimizer(1e-3, grad_clip=0.0).init(params)) == \
      jax.tree.structure(optax.adamw(1e-3).init(params))


def test_one_micro_batch_step_is_the_plain_update_bit_for_bit():
  """'batch_mean' with one micro-batch (the warm-up): the gradient of the batch's own mean loss
  and one AdamW step, exactly as one jitted value_and_grad + update computes them."""
  cfg = SupervisedSchedule(learning_rate=1e-2, total_steps=4, warmup_steps=2, schedule="constant")
  model = make_tiny_model("qwen2", num_layers=1)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  ids = jnp.asarray(np.random.default_rng(0).integers(3, 60, (2, 8)), jnp.int32)
  batch = {"input_ids": ids, "attention_mask": jnp.ones_like(ids),
           "response_mask": jnp.ones_like(ids).at[:, :3].set(0)}
  tx, step = make_sft_step(cfg, graphdef, loss="batch_mean")

  @jax.jit
  def plain(p, opt_state, b):  # (the batch an argument: a constant one would be folded)
    loss, g = jax.value_and_grad(lambda q: batch_loss(nnx.merge(graphdef, q, rest), b))(p)
    updates, opt_state = tx.update(g, opt_state, p)
    return optax.apply_updates(p, updates), opt_state, loss

  got, want = (params, tx.init(params)), (params, tx.init(params))
  for _ in range(3):
    p, o, loss = step(*got, rest, [batch])
    got = (p, o)
    wp, wo, want_loss = plain(*want, batch)
    want = (wp, wo)
    assert float(loss) == float(want_loss)
  jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(got[0]), nnx.to_pure_dict(want[0]))
  with pytest.raises(ValueError, match="takes one micro-batch per update, got 2"):
    step(*got, rest, [batch, batch])
  with pytest.raises(ValueError, match="loss must be one of .*, got 'sum'"):
    make_sft_step(cfg, graphdef, loss="sum")


def test_accumulating_step_weights_gradients_and_divides_by_the_count():
  """w_k-weighted gradient and metric sums over micro-batches, divided by max(sum c_k, 1)."""
  def loss_fn(params, const, mb, step, k):
    del const, step, k
    return jnp.sum(params * mb["x"]), (mb["w"], mb["c"], {"x_max": jnp.max(mb["x"])})

  def apply_fn(state, grads, metrics, total):
    return state - grads, dict(metrics, total=total)

  step = optim.AccumulatingStep(loss_fn, apply_fn, lambda s: (s, jnp.int32(0)), donate=False)
  mbs = [{"x": jnp.asarray([1.0, 2.0]), "w": jnp.float32(2.0), "c": jnp.float32(3.0)},
         {"x": jnp.asarray([4.0, 0.0]), "w": jnp.float32(1.0), "c": jnp.float32(1.0)}]
  state, metrics = step(jnp.zeros(2), mbs)
  np.testing.assert_allclose(state, -(2 * np.asarray([1.0, 2.0]) + np.asarray([4.0, 0.0])) / 4)
  assert float(metrics["total"]) == 4.0 and float(metrics["x_max"]) == 4.0
  assert float(metrics["loss"]) == 0.0 and step.compiled_programs() == 2
  with pytest.raises(ValueError, match="an update needs at least one micro-batch, got none"):
    step(jnp.zeros(2), [])


def test_micro_batch_layout_rounds_rows_to_the_mesh_and_pads_or_packs():
  packed = packing.micro_batch_layout(3, row_len=64, shards=2, seqs_per_row=4,
                                      share_prompts=True)
  assert (packed.rows, packed.row_len, packed.seqs_per_row, packed.share_prompts) == (4, 64, 4, True)
  padded = packing.micro_batch_layout(5, packing=False, shards=4, pad_to=32)
  assert (padded.packing, padded.rows, padded.row_len, padded.pad_to) == (False, 8, 0, 32)
  assert packing.round_up(33, 16) == 48 and packing.round_up(32, 16) == 32
  with pytest.raises(ValueError, match="PackingLayout.row_len must be >= 1 with packing"):
    packing.micro_batch_layout(2)
