"""Shared Stage 3 configuration: every field of `disa_jax.rl.config.TrainConfig`, commented.

The per-experiment file `configs/stage3_paper.py` starts from `get_config()` here and changes only
what an experiment changes (method, backbone, task, beta, proposal). Values follow the paper
(Tables 1-2, App. C.1, Table 5): AdamW at lr 1e-6, 128 prompts per batch, G = 8, max prompt 2048,
max response 16384, beta = 15, evaluation at temperature 0.6 / top-p 0.95 with 32768-token
responses.
Fields the paper does not state are marked "(not stated in the paper)".
"""
import ml_collections


def get_config() -> ml_collections.ConfigDict:
  """The shared defaults (a DISA run; `configs/stage3_paper.py` fills in the experiment)."""
  c = ml_collections.ConfigDict()
  c.seed = 0  # PRNG seed of the run: model-independent randomness (sampling, shuffling).
  c.total_steps = 500  # RL steps, one rollout batch each (not stated in the paper).
  c.log_every = 1  # Write metrics (JSONL + TensorBoard) every this many RL steps.
  c.tensorboard = True  # Also write TensorBoard event files under <workdir>/tb.
  c.progress_bar = True  # tqdm progress bar with ETA on the console.

  c.model = ml_collections.ConfigDict()
  c.model.policy_path = ""  # Local HF directory of the backbone: the initial policy and pi_ref.
  c.model.reference_path = ""  # Local HF directory of pi_ref; '' = the same as policy_path.
  c.model.dtype = "bfloat16"  # Activation dtype of the forward/backward passes.
  c.model.param_dtype = "float32"  # Storage dtype of the trained parameters (AdamW master copy).
  c.model.remat = True  # Recompute decoder layers in the backward pass (long responses).
  c.model.scan_unroll = 1  # Unroll of the scan over layers (num_layers: faster small models, slower compile).

  c.loss = ml_collections.ConfigDict()
  c.loss.method = "disa"  # 'disa' (eq. 8) | 'flowrl' (eq. 5) | 'grpo' (eqs. 1-3) | 'gspo'.
  c.loss.beta = 15.0  # Inverse temperature beta of the TB residual; paper: 15 for DISA and FlowRL.
  # 1/|o| on the residual's log-prob terms as FlowRL's code does (label scale 'mean'); False gives
  # the paper's formal trajectory-sum residual ('sum'). DISA's anchor must use the same scale.
  c.loss.length_normalize = True
  c.loss.reward_transform = ml_collections.ConfigDict()
  c.loss.reward_transform.kind = "group_zscore"  # r -> r~: 'raw' | 'affine' | 'group_zscore'.
  c.loss.reward_transform.scale = 1.0  # a in r~ = a r + b ('affine' only).
  c.loss.reward_transform.shift = 0.0  # b in r~ = a r + b ('affine' only).
  c.loss.reward_transform.eps = 1e-6  # Added to the group std ('group_zscore').
  c.loss.omega_mode = "clipped_ratio"  # Rollout weights omega: 'one' or min(pi/pi_old, omega_max).
  c.loss.omega_max = 10.0  # Clip of the detached trajectory ratio (FlowRL uses 10).
  c.loss.eps_low = 0.2  # GRPO token-ratio clip 1 - eps_low (GSPO: set in stage3_paper.py).
  c.loss.eps_high = 0.28  # GRPO token-ratio clip 1 + eps_high (clip-higher; not in the paper).
  c.loss.dual_clip = 0.0  # GRPO dual clip c > 1 on negative advantages; 0 = off.
  c.loss.kl_coef = 0.0  # GRPO KL penalty to pi_ref; 0 = off (not stated in the paper).
  c.loss.kl_kind = "k3"  # KL estimator for the penalty: 'k1' | 'k3'.
  c.loss.logz_head_layers = 3  # FlowRL log Z head: Linear layers (hidden->hidden x2, then ->1).
  c.loss.logz_head_lr = 1e-6  # FlowRL log Z head learning rate (same optimizer as the policy).
  c.loss.logz_head_init = 0.0  # FlowRL log Z head initial output bias (initial log Z).

  c.optim = ml_collections.ConfigDict()
  c.optim.lr = 1e-6  # AdamW learning rate (paper: 1e-6).
  c.optim.weight_decay = 0.01  # AdamW decoupled weight decay (not stated in the paper).
  c.optim.b1 = 0.9  # Adam first-moment decay.
  c.optim.b2 = 0.999  # Adam second-moment decay.
  c.optim.eps = 1e-8  # Adam epsilon.
  c.optim.grad_clip = 1.0  # Global gradient-norm clip.
  c.optim.warmup_steps = 0  # Linear learning-rate warm-up, in optimizer updates.

  c.rollout = ml_collections.ConfigDict()
  c.rollout.prompts_per_batch = 128  # Prompts per RL step (paper: global batch 128 prompts).
  c.rollout.group_size = 8  # G rollouts per prompt (paper: 8).
  c.rollout.max_prompt_len = 2048  # Prompt token limit (paper: 2048); longer prompts are refused.
  c.rollout.max_response_len = 16384  # Response token limit during training (paper: 16384).
  c.rollout.temperature = 1.0  # Training sampling temperature (not stated in the paper).
  c.rollout.top_p = 1.0  # Training nucleus sampling (1.0 = off).
  c.rollout.top_k = 0  # Training top-k sampling (0 = off).
  c.rollout.engine = "vllm"  # Rollout engine: 'vllm' on GPUs, 'jax' (built-in sampler) elsewhere.
  c.rollout.separate_process = True  # Run the engine in its own spawned process.
  # Old log-probs for importance ratios: 'recompute' (the policy scores the batch once before the
  # updates) or 'engine' (raw log-probs the engine recorded while sampling).
  c.rollout.old_logp_source = "recompute"
  c.rollout.num_minibatches = 4  # Optimizer updates per rollout batch (not stated in the paper).
  c.rollout.micro_batch_size = 8  # Sequences per forward/backward; gradients are accumulated.

  c.data = ml_collections.ConfigDict()
  c.data.train_path = ""  # Training prompts (veRL parquet/jsonl): DAPO-17k / DeepCoder.
  c.data.reward = "math"  # Reward function in disa_jax.rewards: 'math' | 'code'.
  c.data.anchor_path = ""  # Frozen Stage 2 anchor directory (DISA only).
  c.data.shuffle = True  # Reshuffle the prompts every epoch (seeded).

  c.replay = ml_collections.ConfigDict()  # Stage 1 replay (beyond the paper; DISA / FlowRL only)
  c.replay.path = ""  # Stage 1 dataset (jsonl/parquet) whose proposal samples are replayed.
  c.replay.fraction = 0.0  # Share of each prompt's G samples taken from Stage 1 (0 = paper recipe).
  c.replay.schedule = "constant"  # 'constant' | 'linear_decay' (to 0 over decay_steps).
  c.replay.decay_steps = 0  # Steps of the linear decay.
  c.replay.max_ref_logp_drift = 0.05  # Refuse a Stage 1 file scored under another pi_ref (nats).

  c.eval = ml_collections.ConfigDict()
  c.eval.every = 50  # Evaluate every this many RL steps; 0 = never.
  c.eval.paths = ()  # Benchmark prompt files (held-out validation subset for checkpoint selection).
  c.eval.n = 8  # Samples per prompt (Mean@8 for math; 16 for code pass@16).
  c.eval.temperature = 0.6  # Evaluation temperature (paper: 0.6).
  c.eval.top_p = 0.95  # Evaluation top-p (paper: 0.95).
  c.eval.max_tokens = 32768  # Evaluation response length (paper: 32768).

  c.mesh = ml_collections.ConfigDict()
  c.mesh.data = 1  # Data-parallel axis size.
  c.mesh.fsdp = -1  # FSDP axis size (-1 = all remaining devices).
  c.mesh.tensor = 1  # Tensor-parallel axis size.

  c.checkpoint = ml_collections.ConfigDict()
  c.checkpoint.every = 50  # Save every this many RL steps (and at the end).
  c.checkpoint.keep = 3  # Keep the last this many checkpoints.
  c.checkpoint.async_save = True  # Write checkpoints in a background thread.
  return c
