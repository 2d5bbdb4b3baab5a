"""Stage 1 (offline IS labels) of the paper's DISA runs, selected by a config string.

  python launch/stage1.py --config=configs/stage1_paper.py:BACKBONE,TASK[,proposal=P][,beta=B][,impl=I]

BACKBONE qwen2.5-7b | qwen3-4b-base         the reference pi_ref (§3.1)
TASK     math (DAPO-17k-processed) | code (DeepCoder)
proposal qwen3-235b-a22b-instruct-2507 (default, tensor-parallel over 8 GPUs) |
         qwen3-4b-instruct-2507 (the weaker-proposal ablation, Fig. 3)
beta     inverse temperature (paper: 15; the Fig. 4 sweep uses 10 / 15 / 20)
impl     the label facts of a Stage 3 implementation preset (configs/common.py: 'paper' = sums,
         'flowrl_verl' = sample std); the same string in Stages 1, 2 and 3

Paths are local directories/files named by `configs/common.py` (the Stage 2, Stage 3 and SFT configs
read what this one writes); override them with --config.reference_path=...,
--config.proposal_path=..., --config.prompts_path=..., --config.output_dir=.... The label facts
(beta, reward transform, label scale) default to what the Stage 3 configs use, so the Stage 2 anchor
passes Stage 3's compatibility check.
"""
import ml_collections

from configs import common


def _parse(arg: str):
  """(backbone, task, proposal, beta, impl) of a Stage 1 / 2 config string."""
  (backbone, task), extra = common.parse(arg, first=("BACKBONE", "TASK"),
                                         options=("proposal", "beta", "impl"))
  proposal = extra.get("proposal", common.DEFAULT_PROPOSAL)
  common.check(backbone, task, proposal)
  impl = extra.get("impl", "")
  common.label_facts(impl)  # validates it
  return backbone, task, proposal, float(extra.get("beta", common.DEFAULT_BETA)), impl


def get_config(arg: str = "qwen3-4b-base,math") -> ml_collections.ConfigDict:
  """The Stage 1 config of one (backbone, task, proposal, beta, impl); see the module docstring."""
  backbone, task, proposal, beta, impl = run = _parse(arg)
  facts = common.label_facts(impl)
  proposal_path, tp = common.PROPOSALS[proposal]
  c = ml_collections.ConfigDict()
  # --- inputs ---------------------------------------------------------------------------------
  c.prompts_path = common.TASKS[task][0]  # Offline prompt set D_Z = the RL prompts (veRL file).
  c.prompts_format = "auto"  # Loader format: 'auto' | 'verl' | a benchmark format (disa_jax.data).
  c.limit = 0  # Use only the first this many prompts; 0 = all (paper: all 17k math prompts).
  c.reference_path = common.BACKBONES[backbone]  # Local HF directory of pi_ref (Stage 3's backbone).
  c.proposal_path = proposal_path  # Local HF directory of the proposal p_T (served by the engine).
  # Prompt rendering of every model, as Stage 3 renders them: 'chat_template' | 'plain'.
  c.rendering = "chat_template"
  c.max_prompt_len = 2048  # Longest prompt (tokens; paper max_prompt_length); longer ones stop.
  # --- output ---------------------------------------------------------------------------------
  # Stage 1 dataset + stage1_summary.json + stage1_config.json; a rerun resumes here.
  c.output_dir = common.stage1_dir(*run)
  c.dataset_format = "parquet"  # 'parquet' (atomic part files, in <output_dir>/stage1) | 'jsonl'.
  # --- grading and labels -----------------------------------------------------------------------
  c.reward = common.TASKS[task][1]  # Registered reward: 'math' (math-verify) | 'code' (sandbox).
  c.reward_plugins = ()  # Modules imported first that register further rewards by name.
  c.beta = beta  # Inverse temperature beta of eqs. 4 and 7 (paper: 15); must equal Stage 3's objective.beta.
  c.reward_transform = ml_collections.ConfigDict()
  c.reward_transform.kind = "group_zscore"  # r -> r~ over the N samples; = Stage 3's transform.
  c.reward_transform.scale = 1.0  # a in r~ = a r + b ('affine' only).
  c.reward_transform.shift = 0.0  # b in r~ = a r + b ('affine' only).
  c.reward_transform.eps = 1e-6  # Added to the group std ('group_zscore').
  c.reward_transform.ddof = facts["ddof"]  # Group std: 0 population (eq. 3) | 1 sample (veRL).
  # Log-prob scale of the label: 'mean' (1/|o|, Stage 3's objective.scale='mean', FlowRL's code) or
  # 'sum' (the paper's trajectory residual, eqs. 5-10). The dataset keeps the raw sums either way.
  c.label_scale = facts["label_scale"]
  # Proposal log-probs: 'processed' (of the distribution sampled from: temperature 0.6, top-p 0.95)
  # or 'raw' (the unmodified proposal, one extra teacher-forced vLLM pass). Recorded in the dataset.
  c.proposal_logprobs = "processed"
  # --- proposal sampling (App. D.2: the evaluation settings, so up to 32768 tokens) ---------------
  c.sampling = common.sampling(8, max_tokens=32768)  # N = 8 samples per prompt (App. D.3).
  # --- proposal engine ------------------------------------------------------------------------
  c.engine = common.engine("vllm", tensor_parallel_size=tp,
                           max_model_len=common.max_model_len(proposal, 2048 + 32768),
                           startup_timeout_s=3600.0, timeout_s=4 * 3600.0)  # 235B MoE: 8 GPUs.
  # --- log pi_ref scoring (JAX, sharded) --------------------------------------------------------
  c.scorer = ml_collections.ConfigDict()
  c.scorer.dtype = "bfloat16"  # Reference weights/compute dtype (log-softmax is float32 anyway).
  c.scorer.batch_size = 16  # Rows per forward pass (one sequence per row without packing).
  c.scorer.packing = True  # Several sequences per row (segment ids): one compiled shape.
  # Tokens per packed row; 0 = grow to the smallest power of two holding the longest sequence seen.
  # Attention over a row costs L x L whatever the real lengths (memory: [rows, heads,
  # attention_chunk, L] scores per query block), so rows grow with the data instead of a fixed
  # 2,048 + 32,768-token row.
  c.scorer.row_len = 0
  c.scorer.pad_to = 1024  # Without packing: sequence-length bucket (one compilation per bucket).
  c.scorer.chunk_size = 1024  # Vocabulary-chunk rows of the log-prob kernel.
  # Attention query block in tokens (0 = dense). Dense attention materialises [heads, L, L] float32
  # scores per row and layer: 40 GiB for one Qwen3-4B-Base row of L = 18,432 (32 heads x L^2 x 4
  # bytes), 162 GiB at L = 36,864 (rows here reach 2,048 + 32,768 tokens); blocks of 1024 queries
  # hold [heads, 1024, L] at a time (2.25 / 4.5 GiB). benchmarks/plan_memory.py, Stage 3's 4B micro
  # step at L = 18,432: 188 GiB/device dense vs 28 GiB with 1024 (docs/cluster.md).
  c.scorer.attention_chunk = 1024
  c.scorer.attention_impl = "auto"  # As Stage 3's model.attention_impl (configs/stage3_base.py).
  c.scorer.mesh = common.mesh()  # The reference model's mesh.
  # --- run ------------------------------------------------------------------------------------
  c.prompts_per_batch = 64  # Prompts per engine call and per durable write (the resume unit).
  c.progress = True  # tqdm progress bar with samples/s.
  # A rerun into output_dir whose inputs (prompt file, checkpoints: paths and content hashes) or label
  # settings differ from stage1_identity.json stops naming each field; True deletes the old dataset.
  c.overwrite = False
  return c
