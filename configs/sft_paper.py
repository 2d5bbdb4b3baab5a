"""The LoRA-SFT baseline of the paper (§4.2, App. D.4, Table 7), selected by a config string.

  --config=configs/sft_paper.py:BACKBONE        BACKBONE: qwen2.5-7b | qwen3-4b-base

Stage 1 trajectories of the math pipeline (proposal Qwen3-235B-A22B-Instruct-2507) filtered to
verifier reward 1 (about 120k chain-of-thought solutions in the paper), LoRA rank 64 on every
attention and MLP projection of pi_ref, AdamW 2e-5 with a cosine schedule, global batch 128,
3 epochs, max_seq_length 18,432, bf16 compute on GPU/TPU. The merged model is exported in HF format
to ``out_path`` and evaluated with the main results' Mean@8 protocol (vLLM, temperature 0.6,
top-p 0.95), e.g. with ``launch/evaluate.py``.

Paths are local directories named by `configs/common.py` (the Stage 1 dataset that
`configs/stage1_paper.py:BACKBONE,math` writes); override with --config.reference_path=...,
--config.stage1_path=..., --config.out_path=....
"""
import ml_collections

from configs import common


def get_config(arg: str = "qwen2.5-7b") -> ml_collections.ConfigDict:
  """The config of one backbone's SFT baseline."""
  (backbone,), _ = common.parse(arg, first=("BACKBONE",), options=())
  common.check(backbone, "math", common.DEFAULT_PROPOSAL)
  c = ml_collections.ConfigDict()
  c.reference_path = common.BACKBONES[backbone]  # pi_ref, the model fine-tuned
  # The math Stage 1 dataset of the default proposal (parquet part directory).
  c.stage1_path = common.stage1_dataset(backbone, "math", common.DEFAULT_PROPOSAL,
                                        common.DEFAULT_BETA)
  c.out_path = f"sft/{backbone}_math_lora64"  # merged HF export (+ '.ckpt' adapter checkpoints)
  # A rerun whose reference or Stage 1 dataset (content hashes) or SFT settings differ from
  # <out_path>.identity.json stops naming each field; True deletes the export and adapter checkpoints.
  c.overwrite = False
  c.mesh = common.mesh()  # the training mesh
  s = c.sft = ml_collections.ConfigDict()  # every field of disa_jax.sft.baseline.LoRASFTConfig
  s.rank = 64  # Table 7: LoRA rank r = 64
  s.alpha = 128.0  # not stated in the paper: 2r
  s.targets = ["q_kernel", "k_kernel", "v_kernel", "o_kernel", "gate_kernel", "up_kernel",
               "down_kernel"]  # all attention and MLP projections
  s.learning_rate = 2e-5  # Table 7: AdamW 2e-5
  s.warmup_steps = 0  # not stated in the paper
  s.weight_decay = 0.0
  s.grad_clip = 1.0
  s.batch_size = 128  # Table 7: global batch 128
  s.micro_batch_rows = 8  # rows per forward/backward, rounded up to a multiple of data x fsdp (8 -> 12 on fsdp=6); accumulated to 128
  s.epochs = 3  # Table 7
  s.max_seq_len = 18432  # Table 7: max_seq_length
  s.keep_reward = 1.0  # keep verified-correct trajectories only
  s.compute_dtype = "auto"  # bf16 on GPU/TPU (Table 7), float32 on CPU
  s.packing = True  # several sequences per row (segment ids); False: one padded row each
  s.row_len = 0  # tokens per packed row; 0 = the longest kept example rounded up to pad_to
  s.seqs_per_row = 16  # most sequences in one packed row
  s.pad_to = 512  # length bucket of row_len = 0 and, without packing, of each micro-batch
  s.seed = 0
  s.checkpoint_every = 50
  s.remat = True  # long sequences: recompute layer activations in the backward pass
  s.remat_policy = "full"  # what a recomputed layer keeps (as Stage 3's model.remat_policy)
  # Attention query block in tokens (0 = dense). Dense attention materialises [heads, T, T] float32
  # scores per row and layer: 40 GiB for one Qwen3-4B-Base row of T = 18,432 (32 heads x T^2 x 4
  # bytes; 35 GiB for Qwen2.5-7B's 28 heads); blocks of 1024 queries hold 2.25 GiB. At the same row
  # length benchmarks/plan_memory.py's Stage 3 micro step (4B, 8 rows, fsdp = 8) needs 188
  # GiB/device dense and 28 GiB with 1024 (docs/cluster.md).
  s.attention_chunk = 1024
  s.attention_impl = "auto"  # as Stage 3's model.attention_impl (configs/stage3_base.py)
  return c
