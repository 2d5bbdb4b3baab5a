"""Stage 2 (anchor fit) of the paper's DISA runs, selected by the same string as Stage 1.

  python launch/stage2.py --config=configs/stage2_paper.py:BACKBONE,TASK[,proposal=P][,beta=B]

Reads the Stage 1 dataset that `configs/stage1_paper.py` writes for the same string, embeds the
prompts with the reference model, fits g_psi (Table 6: two-layer MLP of width 64, Adam 1e-3, batch
1024, 80 epochs) and saves the frozen anchor at ``anchor_path``, the directory that
`configs/stage3_paper.py:disa,BACKBONE,TASK[,proposal=P][,beta=B]` loads.
"""
import importlib.util
import os

import ml_collections

_HERE = os.path.dirname(os.path.abspath(__file__))


def _stage1():
  path = os.path.join(_HERE, "stage1_paper.py")
  spec = importlib.util.spec_from_file_location("stage1_paper", path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def get_config(arg: str = "qwen3-4b-base,math") -> ml_collections.ConfigDict:
  """The Stage 2 config of one (backbone, task, proposal, beta)."""
  s1 = _stage1()
  backbone, task, proposal, beta = s1._parse(arg)  # pylint: disable=protected-access
  stage1 = s1.get_config(arg)
  c = ml_collections.ConfigDict()
  # The Stage 1 dataset (a parquet part directory, or a .jsonl file).
  c.stage1_path = os.path.join(stage1.output_dir, "stage1")
  c.stage1_format = "auto"  # 'auto' (by suffix) | 'jsonl' | 'parquet'.
  c.reference_path = stage1.reference_path  # pi_ref: embeds the prompts (mean-pooled last hidden).
  # The frozen anchor; the same path as configs/stage3_paper.py's data.anchor_path for this run.
  c.anchor_path = f"anchors/{backbone}_{task}_{proposal}_beta{beta:g}"
  # Embedding cache, validation curve and summary.
  c.output_dir = f"stage2/{backbone}_{task}_{proposal}_beta{beta:g}"
  c.label_kind = "log_z_is"  # Regressed label: 'log_z_is' (eq. 6) | 'jensen_corrected' (+CV^2/2N).
  c.weighting = "none"  # Least-squares weights: 'none' (eq. 7) | 'inverse_variance' (1/(CV^2/N)).
  c.drop_nonfinite = False  # Drop prompts with non-finite labels (listed in the summary) or stop.
  c.fit = ml_collections.ConfigDict()
  c.fit.hidden_sizes = (64,)  # Hidden widths: (64,) = two-layer MLP, width 64 (Table 6).
  c.fit.activation = "relu"  # Hidden activation.
  c.fit.learning_rate = 1e-3  # Adam learning rate (Table 6).
  c.fit.batch_size = 1024  # Prompts per step (Table 6).
  c.fit.epochs = 80  # Epochs (Table 6); the best held-out epoch is kept.
  c.fit.val_fraction = 0.1  # Held-out share of prompts for the validation curve (not stated).
  c.fit.seed = 0  # Split and initialisation seed.
  c.embedding = ml_collections.ConfigDict()
  c.embedding.dtype = "bfloat16"  # Reference dtype; = Stage 3's model.dtype, which embeds there.
  c.embedding.batch_size = 32  # Prompts per forward pass.
  c.embedding.pad_to = 256  # Prompt-length bucket.
  c.embedding.chunk_size = 1024  # Unused for embeddings (shared scorer settings).
  c.embedding.num_devices = 0  # Devices for the reference mesh; 0 = all.
  c.embedding.mesh_data = 1  # Mesh data axis.
  c.embedding.mesh_fsdp = -1  # Mesh FSDP axis (-1 = all remaining devices).
  c.embedding.mesh_tensor = 1  # Mesh tensor axis.
  return c
