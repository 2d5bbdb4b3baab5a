"""Stage 1 collection end to end on a tiny checkpoint with the in-process JAX sampler."""
import numpy as np
import pytest

from disa_jax import estimators as E
from disa_jax.estimators.collect import Stage1Prompt, collect_stage1
from disa_jax.models import from_pretrained
from disa_jax.rewards.graded import Graded
from disa_jax.rollout import SamplingParams, make_local_engine
from disa_jax.scoring.batched import SequenceScorer
from disa_jax.testing import save_tiny_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
  return save_tiny_checkpoint(str(tmp_path_factory.mktemp("ckpt") / "m"), "qwen3", seed=0)


def _reward(responses, metas):  # a deterministic verifier: first generated token is even
  return Graded.ok([float(r.token_ids[0] % 2 == 0) for r in responses])


def test_collect_labels_resume_and_self_proposal_identity(ckpt, tmp_path):
  engine = make_local_engine("jax", ckpt)
  scorer = SequenceScorer(from_pretrained(ckpt), pad_id=0, batch_size=8, pad_to=8)
  prompts = [Stage1Prompt(f"p{i}", f"prompt {i}", tuple(range(5 + i, 9 + i))) for i in range(5)]
  sampling = SamplingParams(n=4, temperature=1.0, max_tokens=5, seed=3, return_raw_logprobs=True)
  kw = dict(engine=engine, ref_scorer=scorer, reward_fn=_reward, decode=lambda ids: str(ids),
            sampling=sampling, beta=2.0, reward_transform=E.RewardTransform(), prompts_per_batch=2,
            progress=False)
  w = E.Stage1Writer(tmp_path / "s1.jsonl")
  stats = collect_stage1(prompts=prompts[:3], writer=w, **kw)
  assert stats["prompts_done"] == 3 and stats["samples"] == 12
  w.close()
  stats = collect_stage1(prompts=prompts, writer=E.Stage1Writer(tmp_path / "s1.jsonl"), **kw)
  assert stats["prompts_done"] == 2 and stats["prompts_skipped"] == 3  # resumed
  data = E.load_stage1(tmp_path / "s1.jsonl")
  assert data.prompt_ids == [p.prompt_id for p in prompts] and data.mask.sum() == 20
  # proposal == reference at temperature 1: log pi_ref - log p_T = 0, so log w = beta * r exactly
  np.testing.assert_allclose(data.logp_ref, data.logp_proposal, atol=2e-4)
  expected = np.log(np.mean(np.exp(2.0 * data.reward), axis=1))
  np.testing.assert_allclose(data.labels, expected, atol=2e-4)
  with pytest.raises(ValueError, match="return_raw_logprobs"):
    collect_stage1(prompts=prompts, writer=w, proposal_logprobs="raw",
                   **dict(kw, sampling=SamplingParams(n=2, max_tokens=3)))
  engine.close()


class _Refuses:
  """An engine / scorer / reward that fails the test if anything calls it."""

  def __getattr__(self, name):
    raise AssertionError(f"{name} called on an empty Stage 1 run")

  def __call__(self, *args, **kwargs):
    raise AssertionError("reward_fn called on an empty Stage 1 run")


def test_collect_with_no_prompts_writes_nothing_and_counts_zero(tmp_path):
  for name in ("s1.jsonl", "s1_parquet"):
    writer = E.Stage1Writer(tmp_path / name)
    stats = collect_stage1(engine=_Refuses(), ref_scorer=_Refuses(), prompts=[],
                           reward_fn=_Refuses(), decode=_Refuses(), writer=writer,
                           sampling=SamplingParams(n=2, max_tokens=3), beta=1.0,
                           reward_transform=E.RewardTransform(), progress=False)
    assert {k: stats[k] for k in ("prompts_done", "prompts_skipped", "samples")} == {
        "prompts_done": 0, "prompts_skipped": 0, "samples": 0}
    assert stats["samples_per_s"] == 0.0 and writer.completed_ids() == set()
  assert not (tmp_path / "s1.jsonl").exists()  # no file is created for nothing
  assert [p.name for p in (tmp_path / "s1_parquet").iterdir()] == [".lock"]  # the writer's lock only


def test_resume_of_a_partly_written_batch_equals_the_uninterrupted_run(ckpt, tmp_path):
  """A kill that cut a batch in two (p2 written, p3 not) is resumed with p3 in its own batch."""
  engine = make_local_engine("jax", ckpt)
  scorer = SequenceScorer(from_pretrained(ckpt), pad_id=0, batch_size=8, pad_to=8)
  prompts = [Stage1Prompt(f"p{i}", f"prompt {i}", tuple(range(5 + i, 9 + i))) for i in range(5)]
  kw = dict(engine=engine, ref_scorer=scorer, reward_fn=_reward, decode=lambda ids: str(ids),
            sampling=SamplingParams(n=3, temperature=1.0, max_tokens=5, seed=11), beta=2.0,
            reward_transform=E.RewardTransform(kind="group_zscore"), prompts_per_batch=2,
            progress=False)
  collect_stage1(prompts=prompts, writer=E.Stage1Writer(tmp_path / "full.jsonl"), **kw)
  lines = (tmp_path / "full.jsonl").read_text().splitlines(keepends=True)
  # What a kill in the middle of writing batch [p2, p3] leaves: p2's line and part of p3's.
  (tmp_path / "cut.jsonl").write_text("".join(lines[:3]) + lines[3][:40])
  with pytest.warns(UserWarning, match="dropping a partial last line"):
    writer = E.Stage1Writer(tmp_path / "cut.jsonl")
  stats = collect_stage1(prompts=prompts, writer=writer, **kw)
  assert (tmp_path / "cut.jsonl").read_text() == "".join(lines)  # record for record, bit for bit
  assert (stats["prompts_done"], stats["prompts_skipped"], stats["prompts_regenerated"]) == (2, 3, 1)
  assert stats["samples"] == 2 * 3
  engine.close()
