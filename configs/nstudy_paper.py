"""The paper's offline-budget study (App. C.3) on real checkpoints, selected by a config string.

  python launch/nstudy.py --config=configs/nstudy_paper.py:BACKBONE,TASK[,proposal=P][,beta=B][,impl=I]

The string is Stage 1's (`configs/stage1_paper.py`); this file wraps that Stage 1 config and adds the
study: a ~500-prompt subset of the training prompts, stratified by k-means on pi_ref's prompt
embeddings (k at the elbow of the SSE curve), a pool of 32 proposal samples per prompt, and
subsamples M in {2, 4, 8, 16}. Override paths as in Stage 1: --config.stage1.reference_path=...,
--config.stage1.proposal_path=..., --config.stage1.prompts_path=..., --config.output_dir=....
"""
import ml_collections

from configs import common, stage1_paper


def get_config(arg: str = "qwen3-4b-base,math") -> ml_collections.ConfigDict:
  """The N-study config of one (backbone, task, proposal, beta, impl); see the module docstring."""
  c = ml_collections.ConfigDict()
  # Stage 1 of the whole prompt set: the subset is drawn from its prompts_path and labelled with its
  # models, rendering, reward, beta and sampling settings (sampling.n is replaced by pool_size).
  c.stage1 = stage1_paper.get_config(arg)
  # Subset file, the pool's Stage 1 run (<output_dir>/stage1), nstudy.json and nstudy.png.
  c.output_dir = c.stage1.output_dir.replace("stage1/", "nstudy/", 1)
  c.subset_size = 500  # Prompts in the stratified subset (paper: ~500).
  c.pool_size = 32  # Proposal samples per prompt in the pool; log Z_pool is the reference (paper: 32).
  c.ms = (2, 4, 8, 16)  # Subsample sizes M (paper: 2, 4, 8, 16).
  c.repeats = 200  # Subsamples of each size per prompt (variance and mean bias over these).
  c.ks = tuple(range(2, 21))  # Candidate k of the k-means elbow (>= 3 increasing values).
  c.kmeans_iters = 50  # Lloyd iterations per k-means run (best SSE of 3 seedings per k).
  c.seed = 0  # Seed of the k-means, the stratified draw and the subsamples.
  # A rerun whose prompt file, pi_ref, label fields, sizes or seed differ from
  # <output_dir>/nstudy_identity.json stops naming each; True deletes the subset, pool and results.
  c.overwrite = False
  # pi_ref's prompt embeddings (mean-pooled final hidden states), as Stage 2 computes them.
  c.embedding = ml_collections.ConfigDict()
  c.embedding.dtype = "bfloat16"  # Reference weights/compute dtype.
  c.embedding.batch_size = 64  # Rows per forward pass.
  c.embedding.packing = True  # Several prompts per row (segment ids): one compiled shape.
  c.embedding.row_len = 0  # Tokens per packed row; 0 = grow with the longest prompt.
  c.embedding.pad_to = 256  # Without packing: sequence-length bucket.
  c.embedding.chunk_size = 1024  # Vocabulary-chunk rows (unused by embeddings; ScorerConfig's field).
  c.embedding.attention_chunk = 1024  # Attention query block (0 = dense), as Stage 2 embeds.
  c.embedding.attention_impl = "auto"  # As Stage 2 embeds (configs/stage3_base.py says what).
  c.embedding.mesh = common.mesh()  # The reference model's mesh.
  return c
