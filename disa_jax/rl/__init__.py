"""Stage 3: anchored trajectory-balance RL (DISA) and the FlowRL, GRPO and GSPO baselines.

A step reads rollout -> score -> update, one module per part, each stage returning a new frozen
batch type (`batch`: `RolloutBatch` -> `ScoredBatch` -> `TrainBatch`):

- `collect`: `RolloutCollector`, sampling + grading into a `RolloutBatch` (`async_rollout`: the
  same, sampled ahead with bounded staleness);
- `scorer`: `BatchScorer`, the reference / old log-probs, the anchor's log Z and the objective's
  per-row signal: a `ScoredBatch`;
- `objectives`: one frozen class per method (`Disa`, `FlowRL`, `Grpo`, `Gspo`), with its
  hyperparameters and declared needs, on the pure loss functions of `losses` (eqs. 1-3, 5, 6, 10);
- `update`: `PolicyUpdater`, the jitted sharded micro-batched AdamW update (`make_train_step`) on
  the packed `TrainBatch` micro-batches, and the push of the new weights to the engine;
- `trainer`: the loop over the parts (`StepParts`), validation, checkpoints and resume;
- `inputs`: what a run is built on besides its config (`StepModels`, `RolloutTask`, `EngineLink`,
  `AnchorInput`);
- `build`: the parts from the config and those inputs, the one anchor check (`validate_anchor`)
  and `build_trainer`, what callers use.

Also: `seeds` (every seed of a run), `prompts` (the resumable prompt stream), `replay` (Stage 1
replay), `logz_head` (FlowRL's head), `config` (what the trainer reads), `metrics` (JSONL +
TensorBoard). Sub-modules are imported on use (``from disa_jax.rl import objectives``) so that
importing the package stays cheap.
"""
