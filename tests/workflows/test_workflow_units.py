"""Fast checks of the workflow pieces: typed configs, paper configs, vocabulary check, summaries."""

import numpy as np
import pytest

from configs import eval_paper, stage1_paper, stage2_paper, stage3_paper
from disa_jax import codec, testing
from disa_jax.data.rows import save_prompts
from disa_jax.estimators import RewardTransform, build_records
from disa_jax.estimators.dataset import STAT_FIELDS, Stage1Data, Stage1Stats
from disa_jax.rollout import flat_weights
from disa_jax.rollout.jax_sampler import JaxSampler
from disa_jax.rollout.types import Completion, SamplingParams
from disa_jax.tasks.prompts import load_prompts
from disa_jax import config as config_lib
from disa_jax.workflows import prompting
from disa_jax.workflows.evaluation import EvalConfig
from disa_jax.workflows.stage1 import Stage1Config
from disa_jax.workflows.stage1 import stage1_summary
from disa_jax.workflows.stage2 import Stage2Config
from disa_jax.workflows.stage3 import Stage3Config, run_stage3
from tests.workflows.conftest import tiny_stage3_config


def _s1(**over):
  c = stage1_paper.get_config("qwen3-4b-base,math")
  for k, v in over.items():
    c[k] = v
  return c


def test_paper_configs_resolve_with_the_papers_settings():
  s1 = Stage1Config.from_config(_s1())
  assert (s1.sampling.n, s1.sampling.temperature, s1.sampling.top_p, s1.beta) == (8, 0.6, 0.95, 15.0)
  assert s1.reference_path.endswith("Qwen3-4B-Base")
  assert s1.proposal_path.endswith("Qwen3-235B-A22B-Instruct-2507")
  assert s1.engine.kind == "vllm" and s1.engine.vllm_kwargs["tensor_parallel_size"] == 8
  assert s1.prompts_path.endswith("dapo-17k-processed.train.parquet") and s1.reward == "math"
  weak = Stage1Config.from_config(stage1_paper.get_config("qwen2.5-7b,code,proposal=qwen3-4b-instruct-2507"))
  assert weak.proposal_path.endswith("Qwen3-4B-Instruct-2507") and weak.reward == "code"
  assert weak.prompts_path.endswith("deepcoder.train.parquet") and weak.reference_path.endswith("Qwen2.5-7B")
  for arg in ("qwen3-4b-base,math", "qwen2.5-7b,code,beta=20",
              "qwen3-4b-base,math,proposal=qwen3-4b-instruct-2507"):
    s2 = Stage2Config.from_config(stage2_paper.get_config(arg))
    s3 = stage3_paper.get_config("disa," + arg)
    assert s2.anchor_path == s3.data.anchor_path  # Stage 2 writes where Stage 3 reads
    s1 = Stage1Config.from_config(stage1_paper.get_config(arg))
    obj = s3.train.objective
    assert s1.beta == obj.beta and s2.stage1_path.startswith(s1.output_dir)
    assert s1.label_scale == obj.scale
    assert s1.reward_transform == RewardTransform(**codec.encode(obj.reward_transform))
  assert (s2.fit.hidden_sizes, s2.fit.learning_rate, s2.fit.batch_size, s2.fit.epochs) == ((64,), 1e-3, 1024, 80)
  ev = eval_paper.get_config("all")
  ev.model_path, ev.output_dir = "m", "o"
  e = EvalConfig.from_config(ev)
  assert len(e.benchmarks) == 9 and (e.math_k, e.code_k, e.temperature, e.top_p, e.max_tokens) == (
      8, 16, 0.6, 0.95, 32768)


@pytest.mark.parametrize("over,match", [
    ({"beta": 0.0}, "beta must be > 0"),
    ({"label_scale": "avg"}, "label_scale"),
    ({"proposal_path": ""}, "proposal_path is required"),
])
def test_bad_stage1_values_name_the_field(over, match):
  with pytest.raises(ValueError, match=match):
    Stage1Config.from_config(_s1(**over))


def test_typed_config_refuses_unknown_and_mistyped_fields():
  d = _s1().to_dict()
  d["sampling"]["temprature"] = 0.5
  with pytest.raises(ValueError, match=r"config.sampling: unknown field\(s\) \['temprature'\]"):
    Stage1Config.from_config(d)
  d = _s1().to_dict()
  d["sampling"]["n"] = "8"
  with pytest.raises(ValueError, match="config.sampling.n must be int"):
    Stage1Config.from_config(d)
  d = _s1().to_dict()
  d["engine"]["kind"] = "sglang"
  with pytest.raises(ValueError, match="engine.kind"):
    Stage1Config.from_config(d)
  cfg = Stage1Config.from_config(_s1())
  assert config_lib.from_mapping(Stage1Config, config_lib.to_dict(cfg)) == cfg  # round trip
  with pytest.raises(ValueError, match=r"benchmarks.gsm8k must be a path string"):
    EvalConfig.from_config({"model_path": "m", "output_dir": "o", "benchmarks": {"gsm8k": 3}})
  with pytest.raises(ValueError, match="every path is empty"):
    EvalConfig.from_config({"model_path": "m", "output_dir": "o", "benchmarks": {"aime24": ""}})


def test_vocabulary_check_accepts_a_superset_and_refuses_a_remap():
  tok = testing.make_tokenizer()
  prompting.check_same_vocabulary(tok, tok)
  bigger = testing.make_tokenizer()
  bigger.add_tokens(["<extra_tool>"])  # the proposal may know more tokens (Qwen3 vs Qwen2.5)
  prompting.check_same_vocabulary(tok, bigger)

  class Remapped:
    def get_vocab(self):
      v = dict(tok.get_vocab())
      v["a"], v["b"] = v["b"], v["a"]
      return v

  with pytest.raises(ValueError, match="disagree on 2 token id"):
    prompting.check_same_vocabulary(tok, Remapped())


def test_proposal_prompt_engine_swaps_prompts():
  seen, seeds = [], []

  class Echo:
    def generate(self, prompts, params):
      seen.extend(prompts)
      seeds.append(params.seed)
      return [[Completion([1], [0.0], None, "length")] * params.n for _ in prompts]

  eng = prompting.ProposalPromptEngine(Echo(), {(1, 2): [7, 8, 9], (3,): [5]})
  out = eng.generate([[3], [1, 2]], SamplingParams(n=2))
  assert seen == [[5], [7, 8, 9]] and [len(o) for o in out] == [2, 2]
  eng.generate([[3], [1, 2]], SamplingParams(n=2))
  eng.generate([[1, 2], [3]], SamplingParams(n=2))
  eng.generate([[1, 2], [3]], SamplingParams(n=2, seed=1))
  # Deterministic per batch; another batch (or seed) gets another random stream.
  assert seeds[0] == seeds[1] and len(set(seeds[1:])) == 3
  with pytest.raises(KeyError, match="no proposal rendering"):
    eng.generate([[4]], SamplingParams())


def test_stage1_summary_counts_prompts_without_reward_and_quantiles():
  rt = RewardTransform(kind="group_zscore")
  rewards = [[0, 0, 0, 0], [1, 0, 0, 0], [1, 1, 0, 1]]
  samples = [[{"token_ids": [1, 2], "text": "x", "logp_ref": -3.0 - j, "logp_proposal": -2.0,
               "reward": float(r), "num_tokens": 2} for j, r in enumerate(row)] for row in rewards]
  recs = build_records(["a", "b", "c"], ["p"] * 3, samples, beta=15.0, reward_transform=rt)
  mask = np.ones((3, 4), bool)
  data = Stage1Data(prompt_ids=["a", "b", "c"], prompts=["p"] * 3,
                    logp_ref=np.array([[s["logp_ref"] for s in r] for r in samples]),
                    logp_proposal=np.full((3, 4), -2.0), reward=np.array(rewards, float),
                    num_tokens=np.full((3, 4), 2), mask=mask,
                    stats=Stage1Stats(**{k: np.array([r[k] for r in recs]) for k in STAT_FIELDS},
                                      n_valid=np.full(3, 4)),
                    beta=15.0, reward_transform=rt, label_scale="sum", proposal_logprobs="processed",
                    records=recs)
  s = stage1_summary(data, {"samples": 12, "seconds": 2.0})
  assert s["share_no_reward"] == pytest.approx(1 / 3)
  assert s["mean_reward"] == pytest.approx(4 / 12) and s["samples"] == 12
  ess = np.array([r["ess"] for r in recs])
  assert s["ess"]["q00"] == pytest.approx(ess.min()) and s["ess"]["q100"] == pytest.approx(ess.max())
  assert s["ess"]["q50"] == pytest.approx(np.median(ess))
  assert s["ess_fraction"]["q100"] == pytest.approx(ess.max() / 4)
  assert s["nonfinite_labels"]["count"] == 0 and s["run"]["samples"] == 12


def write_stage1_run(tmp_path, reference, samples, *, label_scale="mean"):
  """A hand-made Stage 1 output directory: its dataset, prompt file and stage1_config.json."""
  import json
  from disa_jax.data.records import PromptRecord
  from disa_jax.estimators import Stage1Writer
  prompts = tmp_path / "prompts.jsonl"
  save_prompts([PromptRecord(f"q{i}", f"prompt number {i}", "a", "toy")
                for i in range(len(samples))], str(prompts))
  ids = [r.prompt_id for r in load_prompts(str(prompts))]
  out = tmp_path / "s1"
  out.mkdir()
  recs = build_records(ids, [f"prompt number {i}" for i in range(len(samples))], samples,
                       beta=15.0, reward_transform=RewardTransform(kind="group_zscore"),
                       label_scale=label_scale)
  Stage1Writer(out / "stage1.jsonl").write(recs)
  (out / "stage1_config.json").write_text(json.dumps({
      "prompts_path": str(prompts), "prompts_format": "auto", "limit": 0, "rendering": "plain",
      "max_prompt_len": 64, "reference_path": reference}))
  return str(out / "stage1.jsonl"), ids


def test_stage2_stops_on_nonfinite_labels_or_drops_and_lists_them(checkpoints, tmp_path):
  from disa_jax.workflows.stage2 import run_stage2
  samples = [[{"token_ids": [7, 8], "text": "ab", "logp_ref": -2.0 - j - i, "logp_proposal": -2.5,
               "reward": float(j % 2), "num_tokens": 2} for j in range(3)] for i in range(6)]
  for s in samples[4]:
    s["logp_ref"] = float("-inf")  # pi_ref gives every sample zero probability: log Z_IS = -inf
  path, ids = write_stage1_run(tmp_path, checkpoints["reference"], samples)
  c = stage2_paper.get_config("qwen3-4b-base,math")
  c.stage1_path, c.reference_path = path, checkpoints["reference"]
  c.anchor_path, c.output_dir = str(tmp_path / "anchor"), str(tmp_path / "s2")
  c.fit.epochs, c.fit.batch_size, c.fit.val_fraction = 2, 4, 0.0
  c.embedding.dtype, c.embedding.batch_size, c.embedding.pad_to = "float32", 8, 16
  c.embedding.mesh.num_devices = 1
  with pytest.raises(ValueError, match=rf"1 Stage 1 prompt\(s\) have non-finite labels.*{ids[4]}"):
    run_stage2(Stage2Config.from_config(c))
  c.drop_nonfinite = True
  s = run_stage2(Stage2Config.from_config(c))
  assert s.dropped_nonfinite == (ids[4],) and s.prompts_fitted == 5 and s.prompts == 6
  assert s.label_scale == "mean" and s.sigma_g_val is None


def test_stage2_leaves_excluded_prompts_out_of_the_fit_but_predicts_them(checkpoints, tmp_path):
  """A held-out prompt file: those prompts neither train nor validate the fit (the fit of the rest
  is the same whatever their labels), yet are embedded and predicted; an id not in Stage 1 is
  refused naming it; the exclusion is part of the output's identity."""
  from disa_jax.checkpoint.identity import IdentityMismatchError
  from disa_jax.data.records import PromptRecord
  from disa_jax.workflows.stage2 import run_stage2
  samples = [[{"token_ids": [7, 8], "text": "ab", "logp_ref": -2.0 - j - i, "logp_proposal": -2.5,
               "reward": float(j % 2), "num_tokens": 2} for j in range(3)] for i in range(6)]
  path, ids = write_stage1_run(tmp_path, checkpoints["reference"], samples)
  held = tmp_path / "held.jsonl"
  save_prompts([PromptRecord(ids[i], f"prompt number {i}", "a", "toy") for i in (1, 4)],
               str(held))
  c = stage2_paper.get_config("qwen3-4b-base,math")
  c.stage1_path, c.reference_path = path, checkpoints["reference"]
  c.fit.epochs, c.fit.batch_size, c.fit.val_fraction = 3, 4, 0.0
  c.embedding.dtype, c.embedding.batch_size, c.embedding.pad_to = "float32", 8, 16
  c.embedding.mesh.num_devices = 1
  c.exclude_prompts_path = str(held)

  def fit(name, rows):
    c.anchor_path, c.output_dir = str(tmp_path / f"anchor_{name}"), str(tmp_path / f"s2_{name}")
    p, _ = write_stage1_run(tmp_path / name, checkpoints["reference"], rows) if name != "a" else (
        path, None)
    c.stage1_path = p
    return run_stage2(Stage2Config.from_config(c))

  a = fit("a", samples)
  assert a.prompts == 6 and a.prompts_fitted == 4 and set(a.predictions()) == set(ids)
  other = [[dict(s, logp_ref=s["logp_ref"] - (5.0 if i in (1, 4) else 0.0)) for s in row]
           for i, row in enumerate(samples)]  # only the excluded prompts' labels differ
  (tmp_path / "b").mkdir()
  b = fit("b", other)
  pa, pb = a.predictions(), b.predictions()
  for i, pid in enumerate(ids):
    assert pa[pid] == pytest.approx(pb[pid], abs=1e-6), pid
  c.anchor_path, c.output_dir, c.stage1_path = str(tmp_path / "anchor_a"), str(tmp_path / "s2_a"), path
  c.exclude_prompts_path = ""
  with pytest.raises(IdentityMismatchError, match="excluded_prompt_ids"):
    run_stage2(Stage2Config.from_config(c))
  save_prompts([PromptRecord("nope", "x", "a", "toy")], str(tmp_path / "bad.jsonl"))
  c.exclude_prompts_path = str(tmp_path / "bad.jsonl")
  c.anchor_path, c.output_dir = str(tmp_path / "anchor_c"), str(tmp_path / "s2_c")
  with pytest.raises(ValueError, match=r"exclude_prompts_path=.*not in the Stage 1 dataset.*nope"):
    run_stage2(Stage2Config.from_config(c))


@pytest.mark.parametrize("bad", [-1, True])
def test_a_bad_push_bucket_size_is_refused_naming_the_field(bad):
  c = stage3_paper.get_config("grpo,qwen3-4b-base,math")
  c.engine.push_bucket_bytes = bad
  with pytest.raises(ValueError, match=r"engine.push_bucket_bytes"):
    Stage3Config.from_config(c)


def test_the_push_bucket_size_of_the_config_is_the_one_stage3_pushes_with(tmp_path, monkeypatch):
  """`engine.push_bucket_bytes` reaches the flat export of every weight push of a Stage 3 run.

  (An in-process JAX sampler takes the trainer's weights on the devices, `JaxSampler.load_params`,
  with no flat export; without that method the run pushes flat, as to any other engine.)"""
  c = tiny_stage3_config(tmp_path, separate_process=False, steps=1)
  c.engine.push_bucket_bytes, c.export = 4096, False
  seen = []
  export = flat_weights.export
  monkeypatch.delattr(JaxSampler, "load_params")

  def recording(*args, **kwargs):
    out = export(*args, **kwargs)
    seen.append((out.layout.bucket_bytes, len(out.buffers)))
    return out

  monkeypatch.setattr(flat_weights, "export", recording)
  run_stage3(Stage3Config.from_config(c))
  # (the default, 1 GiB, holds the tiny model in one bucket)
  assert seen and all(size == 4096 and buckets > 1 for size, buckets in seen), seen
