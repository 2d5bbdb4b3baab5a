"""Shared Stage 3 configuration: every field of `disa_jax.workflows.stage3.Stage3Config`, commented.

`configs/stage3_paper.py` starts from `get_config()` here and changes only what an experiment
changes (objective, backbone, task, beta, proposal, replay, implementation preset). Values follow the
paper (App. D.1, Table 5): AdamW at lr 1e-6, 128 prompts per batch, G = 8, max prompt 2048, max
response 16384, beta = 15, evaluation at temperature 0.6 / top-p 0.95 with 32768-token responses.
Fields the paper does not state are marked "(not stated in the paper)". The objective section holds
the fields of the chosen `disa_jax.rl.objectives` class (documented there), starting from the
class's defaults.
"""
import ml_collections

from configs import common
from disa_jax.rl import objectives


def objective(name: str) -> ml_collections.ConfigDict:
  """The objective section: ``name`` and every field of its class, at the class defaults."""
  return ml_collections.ConfigDict(objectives.default_config(name))


def get_config() -> ml_collections.ConfigDict:
  """The shared defaults (a DISA run; `configs/stage3_paper.py` fills in the experiment)."""
  c = ml_collections.ConfigDict()
  c.workdir = ""  # Run directory (metrics, checkpoints, final/); launch/train.py's --workdir sets it.
  c.export = True  # Export the final policy to <workdir>/final as a Hugging Face directory.
  # Which checkpoint final/ holds: 'best' (by validation Mean@n, the paper's checkpoint selection;
  # the latest when the run never validated) | 'latest' | a step number.
  c.export_checkpoint = "best"
  # Storage dtype of that export (sharded safetensors with an index): 'bfloat16' | 'float32'.
  c.export_dtype = "bfloat16"
  # A rerun whose models, prompt / anchor / replay files (content hashes) or model settings differ
  # from <workdir>/identity.json stops naming each field; True deletes the checkpoints, metrics, final/.
  c.overwrite = False

  c.model = ml_collections.ConfigDict()
  c.model.policy_path = ""  # Local HF directory of the backbone: the initial policy and pi_ref.
  c.model.reference_path = ""  # Local HF directory of pi_ref; '' = the same as policy_path.
  c.model.dtype = "bfloat16"  # Activation dtype of the forward/backward passes.
  c.model.param_dtype = "float32"  # Storage dtype of the trained parameters (AdamW master copy).
  c.model.remat = True  # Recompute decoder layers in the backward pass (long responses).
  # What a recomputed layer keeps: 'full' (nothing), 'save_attn', 'save_qkv_attn', 'save_qkv_attn_mlp'
  # (disa_jax/models/transformer.py remat_policy; benchmarks/plan_memory.py --remat-policy).
  c.model.remat_policy = "full"
  c.model.scan_unroll = 1  # Unroll of the scan over layers (num_layers: faster small models).
  # Attention query chunk of the policy and pi_ref, in tokens ('xla' / 'dense' attention); 0 = no
  # chunking (the implementation's own query blocks, their probabilities kept for the backward).
  # attention_impl='dense' without chunks materialises [heads, T, T] float32 scores per packed
  # row: at the paper's T = 2048 + 16384 =
  # 18,432, benchmarks/plan_memory.py (fsdp = 8, 8 rows) puts the micro step at 188 GiB/device for
  # Qwen3-4B-Base (176 for Qwen2.5-7B) dense and 28 (38) GiB with 1024 (docs/cluster.md).
  c.model.attention_chunk = 1024
  # Attention over packed rows: 'auto' = cuDNN flash attention on a GPU (per segment, no [T, T]
  # scores; attention_chunk then unused), block-sparse XLA elsewhere; 'xla' | 'pallas' | 'cudnn' |
  # 'splash' | 'dense' (disa_jax/models/attention_dispatch.py).
  c.model.attention_impl = "auto"

  c.data = ml_collections.ConfigDict()
  c.data.train_path = ""  # Training prompts (veRL parquet/jsonl): DAPO-17k / DeepCoder.
  c.data.prompts_format = "auto"  # Loader format: 'auto' | 'verl' | a benchmark format.
  c.data.reward = "math"  # Registered reward: 'math' | 'code' | 'sum_task' | a plugin's.
  c.data.reward_plugins = ()  # Modules imported first that register further rewards by name.
  c.data.rendering = "chat_template"  # Prompt rendering, as in Stages 1-2: 'chat_template' | 'plain'.
  c.data.anchor_path = ""  # Frozen Stage 2 anchor directory (DISA only).
  c.data.replay_path = ""  # Stage 1 dataset replayed when train.replay.fraction > 0.
  c.data.validation_paths = ()  # Held-out prompt files for periodic validation.

  # The policy's rollout engine ('jax' on machines without vLLM). Its max_model_len holds the longest
  # request: validation's max_prompt_len + validation.max_tokens = 2048 + 32768 (rollouts need
  # 2048 + 16384), within the served model's context (configs/stage3_paper.py: 32768 on
  # Qwen3-4B-Base, where vLLM ends a longer response at the context); `--dry_run` checks both
  # against the policy's config.json.
  c.engine = common.engine("vllm", max_model_len=2048 + 32768)
  c.mesh = common.mesh()  # The training mesh.

  t = c.train = ml_collections.ConfigDict()  # What the Trainer reads (disa_jax.rl.config).
  t.objective = objective("disa")  # name + the class's fields (see disa_jax/rl/objectives.py).
  t.seed = 0  # PRNG seed of the run: sampling, shuffling, replay draws, the log Z head.
  t.total_steps = 500  # RL steps, one rollout batch each (not stated in the paper).
  t.shuffle = True  # Reshuffle the prompts every epoch (seeded).
  t.log_every = 1  # Write metrics (JSONL + TensorBoard) every this many RL steps.
  t.tensorboard = True  # Also write TensorBoard event files under <workdir>/tb.
  t.wandb = ml_collections.ConfigDict()  # Weights & Biases sink (optional extra `disa_jax[wandb]`).
  t.wandb.enabled = False  # Also log every metrics row to wandb; resume continues the same run.
  t.wandb.project = "disa_jax"  # wandb project.
  t.wandb.entity = ""  # wandb team or user ('' = the logged-in user's default entity).
  t.wandb.name = ""  # Run name ('' = the run directory's base name).
  t.wandb.tags = ()  # Run tags, e.g. ('disa', 'qwen3-4b').
  t.wandb.mode = "online"  # 'online' | 'offline' (then `wandb sync <workdir>/wandb/offline-run-*`).
  t.progress_bar = True  # tqdm progress bar with ETA on the console.

  t.optim = ml_collections.ConfigDict()
  t.optim.lr = 1e-6  # AdamW learning rate (paper: 1e-6).
  t.optim.weight_decay = 0.01  # AdamW decoupled weight decay (not stated in the paper).
  t.optim.b1 = 0.9  # Adam first-moment decay.
  t.optim.b2 = 0.999  # Adam second-moment decay.
  t.optim.eps = 1e-8  # Adam epsilon.
  t.optim.grad_clip = 1.0  # Global gradient-norm clip.
  t.optim.warmup_steps = 0  # Linear learning-rate warm-up, in optimizer updates.
  t.optim.decay_frac = 0.0  # The last this share of updates runs at lr * decay_factor (0 = off).
  t.optim.decay_factor = 0.1  # Learning-rate factor of that final phase.

  t.rollout = ml_collections.ConfigDict()
  t.rollout.prompts_per_batch = 128  # Prompts per RL step (paper: global batch 128 prompts).
  t.rollout.group_size = 8  # G rollouts per prompt (paper: 8).
  t.rollout.max_prompt_len = 2048  # Prompt token limit (paper: 2048); longer prompts are refused.
  t.rollout.max_response_len = 16384  # Response token limit during training (paper: 16384).
  t.rollout.temperature = 1.0  # Training sampling temperature (not stated in the paper).
  t.rollout.top_p = 1.0  # Training nucleus sampling (1.0 = off).
  t.rollout.top_k = 0  # Training top-k sampling (0 = off).
  # Old log-probs for importance ratios: 'recompute' (the policy scores the batch once before the
  # updates) or 'engine' (raw log-probs the engine recorded while sampling).
  t.rollout.old_logp_source = "recompute"
  t.rollout.num_minibatches = 4  # Optimizer updates per rollout batch (not stated in the paper).
  # Sequence packing (disa_jax/data/packing.py): several sequences per row, told apart by segment
  # ids; False = one sequence per row, every row padded to the batch's longest (for comparison).
  t.rollout.packing = True
  t.rollout.row_len = 0  # Tokens per packed row; 0 = max_prompt_len + max_response_len.
  # Rows per forward/backward and per scoring pass, rounded up to a multiple of the mesh's
  # data x fsdp batch shards (8 -> 12 on fsdp=6, 8 -> 24 on 24 devices: every device gets whole
  # rows); the micro-batches of a mini-batch are a token budget of rows x row_len tokens each.
  t.rollout.micro_batch_rows = 8
  t.rollout.seqs_per_row = 16  # Most sequences in one packed row.
  # Packing only: each prompt once per row, followed by its responses (each attends to the prompt
  # and to itself only: the same log-probs and gradients, the prompt computed once, not G times).
  t.rollout.share_prompts = False
  # Asynchronous rollouts (disa_jax/rl/async_rollout.py): the engine samples up to k batches ahead
  # of the update, batch t from the weights after step t - k (0 = synchronous). TB objectives
  # weight stale rows by the behaviour's log-probs; GRPO/GSPO correct them with is_correction.
  t.rollout.max_staleness = 0
  # |log pi_trainer - log pi_engine| above this (nats) counts in mismatch/frac_over.
  t.rollout.mismatch_threshold = 0.1

  t.replay = ml_collections.ConfigDict()  # Stage 1 replay (beyond the paper; DISA / FlowRL only)
  t.replay.fraction = 0.0  # k / G: Stage 1 samples per prompt's group, over G (0 = paper recipe).
  t.replay.mode = "replace"  # 'replace': k of the G slots | 'add': G on-policy + k replayed rows.
  t.replay.correct_only = False  # Replay only the Stage 1 samples the verifier accepted.
  t.replay.dedupe = False  # A response drawn several times in Stage 1 counts once.
  t.replay.schedule = "constant"  # 'constant' | 'linear_decay' (to 0 over decay_steps).
  t.replay.decay_steps = 0  # Steps of the linear decay.
  t.replay.max_ref_logp_drift = 0.05  # Refuse a Stage 1 file scored under another pi_ref (nats).

  t.validation = ml_collections.ConfigDict()
  t.validation.every = 50  # Validate every this many RL steps (needs data.validation_paths); 0 = never.
  t.validation.at_start = True  # Also validate the initial policy (step 0; a selection candidate).
  # Other cadences before `every` (0 = none; the main job's tracking sets them):
  t.validation.early_every = 0  # every this many steps before step dense_from
  t.validation.dense_from = 0  # the first step of the `every` cadence (with early_every)
  t.validation.start_every = 0  # before both: every this many steps ...
  t.validation.start_until = 0  # ... up to this step
  t.validation.n = 8  # Samples per prompt (Mean@8 for math; 16 for code pass@16).
  t.validation.temperature = 0.6  # Validation temperature (paper: 0.6).
  t.validation.top_p = 0.95  # Validation top-p (paper: 0.95).
  t.validation.max_tokens = 32768  # Validation response length (paper: 32768).

  t.checkpoint = ml_collections.ConfigDict()
  t.checkpoint.every = 50  # Save every this many RL steps (and at the end).
  t.checkpoint.keep = 3  # Keep the last this many checkpoints, plus the best by validation.
  t.checkpoint.async_save = True  # Write checkpoints in a background thread.
  # Exact measures every train.validation.every steps (enumerable correct sets only, e.g. the sum task).
  c.exact_target = common.exact_target()
  return c
