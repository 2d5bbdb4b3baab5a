"""Benchmark evaluation with the paper's protocol (App. D.1), selected by a config string.

  python launch/evaluate.py --config=configs/eval_paper.py:SUITE --config.model_path=CKPT \
      --config.output_dir=eval/NAME

SUITE math (AIME24, AIME25, AMC23, MATH-500, Minerva, OlympiadBench; Mean@8) |
      code (LiveCodeBench, CodeForces, HumanEval+; pass@1 and pass@16) | all |
      task (one custom prompt file: --config.benchmarks.task=PATH, graded by its rows' ability)

CKPT is any local HF directory (a backbone, any HF model); for a Stage 3 run give
--config.run_dir=WORKDIR instead (its best checkpoint by validation, or --config.run_checkpoint=latest
or =S, is exported to <output_dir>/policy_step<S> first; summary.json says which and why). Benchmark files live under data/benchmarks/ by default; override
one with --config.benchmarks.aime24=PATH, or skip it with --config.benchmarks.aime24=''.
"""
import ml_collections

from configs import common

BENCHMARK_FILES = {  # name -> default local file (formats: disa_jax.tasks.prompts)
    "aime24": "data/benchmarks/aime24.jsonl",
    "aime25": "data/benchmarks/aime25.jsonl",
    "amc23": "data/benchmarks/amc23.jsonl",
    "math500": "data/benchmarks/math500.jsonl",
    "minerva": "data/benchmarks/minerva.jsonl",
    "olympiadbench": "data/benchmarks/olympiadbench.jsonl",
    "livecodebench": "data/benchmarks/livecodebench.json",
    "codeforces": "data/benchmarks/codeforces.json",
    "humanevalplus": "data/benchmarks/HumanEvalPlus.jsonl.gz",
}
SUITES = {
    "math": ("aime24", "aime25", "amc23", "math500", "minerva", "olympiadbench"),
    "code": ("livecodebench", "codeforces", "humanevalplus"),
}
SUITES["all"] = SUITES["math"] + SUITES["code"]
# A custom task: one prompt file (veRL rows) graded by the registered reward of its rows' ability,
# e.g. the main job's sum task (ability 'sum_task', with exact_target for its exact measures).
SUITES["task"] = ("task",)
BENCHMARK_FILES["task"] = ""


def get_config(arg: str = "math") -> ml_collections.ConfigDict:
  """The evaluation config of one suite; see the module docstring."""
  if arg not in SUITES:
    raise ValueError(f"config SUITE must be one of {sorted(SUITES)}, got {arg!r}")
  c = ml_collections.ConfigDict()
  c.model_path = ""  # Local HF directory to evaluate (a backbone, any HF model); or set run_dir.
  c.run_dir = ""  # A launch/train.py workdir: its policy checkpoint is exported and evaluated.
  # Checkpoint of run_dir to export: 'best' (by validation, as the paper reports; the latest when
  # the run never validated) | 'latest' | a step number.
  c.run_checkpoint = "best"
  c.output_dir = ""  # Tables and responses; a rerun skips finished benchmarks (required).
  c.label = ""  # Row name in the tables; '' = the checkpoint directory's name.
  # A benchmark whose <name>.identity.json records another model (path or content hash, e.g. a later
  # run_step), benchmark file or sampling setting stops naming each field; True re-evaluates it.
  c.overwrite = False
  c.benchmarks = ml_collections.ConfigDict(
      {name: BENCHMARK_FILES[name] for name in SUITES[arg]})  # name -> file; '' skips it.
  c.limit = 0  # Problems per benchmark; 0 = all.
  # Problems sampled and graded between saves of their rows to <name>_responses.jsonl: a SIGTERM
  # stops the evaluation after the slice in progress and the rerun resumes from there (the samples
  # do not depend on it).
  c.save_every = 64
  c.math_k = 8  # Samples per math problem: Mean@8 (paper).
  c.code_k = 16  # Samples per code problem: pass@1 and pass@16 (paper).
  c.temperature = 0.6  # Sampling temperature (paper: 0.6).
  c.top_p = 0.95  # Top-p (paper: 0.95).
  c.max_tokens = 32768  # Response length (paper: 32768).
  c.seed = 0  # Sampling seed.
  c.stop_token_ids = ()  # Stop ids; () = tokenizer eos + generation_config eos + end of turn.
  c.rendering = "chat_template"  # Prompt rendering: 'chat_template' | 'plain' (as in training).
  c.max_prompt_len = 4096  # Longest prompt (tokens); a longer one stops with its id.
  c.reward_plugins = ()  # Modules imported first that register further rewards by name.
  # Serves the checkpoint. max_model_len None = the served model's own context (its config.json;
  # 32768 for Qwen3-4B-Base, where vLLM ends a response at the context, 131072 for Qwen2.5-7B):
  # the model is only known at run time. `--dry_run` checks max_prompt_len + max_tokens against it.
  c.engine = common.engine("vllm", startup_timeout_s=1800.0, timeout_s=6 * 3600.0)
  c.engine.vllm_kwargs.max_model_len = ml_collections.config_dict.placeholder(int)
  c.exact_target = common.exact_target()  # Exact evaluation (enumerable correct sets only).
  c.local_diversity = False  # Distinct answers + mean pairwise distance per problem (offline).
  c.judge_url = ""  # OpenAI-compatible endpoint of the App. D.5 judge; '' = no judge.
  c.judge_model = "gpt-4o-mini"  # Judge model (paper: GPT-4o-mini).
  c.judge_api_key_env = "OPENAI_API_KEY"  # Environment variable holding the judge's API key.
  c.judge_cache_dir = ""  # On-disk cache of judge answers; '' = none.
  c.diversity_benchmarks = ("aime24", "aime25")  # Benchmarks the judge scores (paper: AIME 24+25).
  c.diversity_k = 8  # Responses per problem shown to the judge / local metric (paper: 8).
  c.export_dtype = "bfloat16"  # Storage dtype of a run_dir checkpoint's export: 'bfloat16' | 'float32'.
  return c
