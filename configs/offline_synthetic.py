"""Stage 1 + Stage 2 on the tabular synthetic problem with an exact partition function.

    python -m launch.offline --config=configs/offline_synthetic.py --workdir=/tmp/disa_offline
    python -m launch.offline --config=configs/offline_synthetic.py --config.stage1.samples=16 --workdir=...

Read by `disa_jax.pipeline.offline_job.OfflineConfig`: unknown fields and bad values stop the run,
naming the field.
"""
import ml_collections


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0  # seeds the problem, the proposal samples and the regressor

  c.problem = ml_collections.ConfigDict()
  c.problem.prompts = 2000  # P: prompts (the offline budget D_Z)
  c.problem.outputs = 64  # K: possible outputs per prompt
  c.problem.dim = 16  # D: prompt-embedding width
  c.problem.n_correct = 6  # correct outputs per prompt (reward 1)
  c.problem.beta = 3.0  # inverse temperature of the target pi_ref * exp(beta r) / Z
  c.problem.proposal_beta = 2.0  # the proposal's own tilt towards correct outputs
  c.problem.proposal_mix = 0.2  # uniform share of the proposal (keeps full support)

  c.stage1 = ml_collections.ConfigDict()
  c.stage1.samples = 8  # N: proposal samples per prompt (paper: 8)
  c.stage1.reward_transform = ml_collections.ConfigDict()  # r -> r~ in the IS weights (RewardTransform)
  c.stage1.reward_transform.kind = "raw"  # raw | affine | group_zscore
  c.stage1.chunk = 250  # prompts per durable write (a killed run loses at most one chunk)
  c.stage1.format = "jsonl"  # jsonl | parquet
  c.stage1.n_study = (2, 4, 8, 16)  # M values of the App. D.3 study against the exact log Z
  c.stage1.n_study_repeats = 32  # subsamples per prompt and M

  c.stage2 = ml_collections.ConfigDict()
  c.stage2.hidden_sizes = (64,)  # (64,) = the paper's two-layer MLP of width 64
  c.stage2.learning_rate = 1e-3  # Adam (Table 6)
  c.stage2.batch_size = 128  # Table 6 uses 1024 for 17k prompts; 128 gives 2k prompts as many steps
  c.stage2.epochs = 80  # Table 6
  c.stage2.val_fraction = 0.1  # held-out prompts for val MSE / R^2 and best-epoch selection
  return c
