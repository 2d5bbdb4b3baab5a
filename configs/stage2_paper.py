"""Stage 2 (anchor fit) of the paper's DISA runs, selected by the same string as Stage 1.

  python launch/stage2.py --config=configs/stage2_paper.py:BACKBONE,TASK[,proposal=P][,beta=B][,impl=I]

Reads the Stage 1 dataset that `configs/stage1_paper.py` writes for the same string, embeds the
prompts with the reference model, fits g_psi (Table 6: two-layer MLP of width 64, Adam 1e-3, batch
1024, 80 epochs) and saves the frozen anchor at ``anchor_path``, the directory that
`configs/stage3_paper.py:disa,BACKBONE,TASK[,proposal=P][,beta=B]` loads (`configs/common.py` names
them all).
"""
import ml_collections

from configs import common
from configs import stage1_paper


def get_config(arg: str = "qwen3-4b-base,math") -> ml_collections.ConfigDict:
  """The Stage 2 config of one (backbone, task, proposal, beta, impl)."""
  backbone, *_ = run = stage1_paper._parse(arg)  # pylint: disable=protected-access
  c = ml_collections.ConfigDict()
  # The Stage 1 dataset (a parquet part directory, or a .jsonl file) inside Stage 1's output_dir,
  # whose stage1_config.json gives the prompt file and rendering the prompts are re-encoded with.
  c.stage1_path = common.stage1_dataset(*run)
  c.stage1_format = "auto"  # 'auto' (by suffix) | 'jsonl' | 'parquet'.
  c.reference_path = common.BACKBONES[backbone]  # pi_ref: embeds the prompts (mean-pooled last hidden).
  c.anchor_path = common.anchor_dir(*run)  # = stage3 data.anchor_path.
  c.output_dir = common.stage2_dir(*run)  # Embeddings, curve, summary.
  # A rerun whose Stage 1 dataset, reference (content hashes), labels, weighting, samples or fit differ
  # from stage2_identity.json stops naming each field; True deletes the old anchor, summary and cache.
  c.overwrite = False
  c.samples = 0  # Labels from the first this many samples of each prompt; 0 = all (paper: N = 8).
  c.labels = "plain"  # 'plain' (log Z_IS, eq. 8) | 'jensen' (+CV^2/2N) | 'jackknife'.
  c.weighting = "uniform"  # Least squares weights: 'uniform' (eq. 9) | 'inverse_variance'.
  c.drop_nonfinite = False  # Drop prompts with non-finite labels (listed in the summary) or stop.
  # A prompt file whose prompts the fit leaves out entirely (neither trained on nor used to pick the
  # epoch; still embedded, so the anchor predicts them): a held-out set ('' = none).
  c.exclude_prompts_path = ""
  c.fit = ml_collections.ConfigDict()
  c.fit.hidden_sizes = (64,)  # Hidden widths: (64,) = two-layer MLP, width 64 (Table 6).
  c.fit.activation = "relu"  # Hidden activation.
  c.fit.learning_rate = 1e-3  # Adam learning rate (Table 6).
  c.fit.batch_size = 1024  # Prompts per step (Table 6).
  c.fit.epochs = 80  # Epochs (Table 6); the best held-out epoch is kept.
  c.fit.val_fraction = 0.1  # Held-out share of prompts for the validation curve (not stated).
  c.fit.seed = 0  # Split and initialisation seed.
  c.fit.huber_delta = 0.0  # 0: least squares (eq. 9); > 0: Huber loss (standardised units).
  c.embedding = ml_collections.ConfigDict()
  c.embedding.dtype = "bfloat16"  # Reference dtype; = Stage 3's model.dtype, which embeds there.
  c.embedding.batch_size = 32  # Rows per forward pass (one prompt per row without packing).
  c.embedding.packing = True  # Several prompts per row (segment ids).
  c.embedding.row_len = 0  # Tokens per packed row; 0 = grow with the longest prompt.
  c.embedding.pad_to = 256  # Without packing: prompt-length bucket.
  c.embedding.chunk_size = 1024  # Vocabulary-chunk rows (shared scorer settings; unused here).
  # Attention query block in tokens (0 = dense [heads, L, L] float32 scores per row); as Stage 1's
  # scorer.attention_chunk (configs/stage1_paper.py says why 1024 for the 4B / 7B models).
  c.embedding.attention_chunk = 1024
  c.embedding.attention_impl = "auto"  # As Stage 3's model.attention_impl (configs/stage3_base.py).
  c.embedding.mesh = common.mesh()  # The reference model's mesh.
  return c
