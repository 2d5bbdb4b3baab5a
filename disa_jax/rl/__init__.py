"""Stage 3: anchored trajectory-balance RL (DISA) and the FlowRL, GRPO and GSPO baselines.

A step reads rollout -> score -> objective -> update -> sync, one module per part:

- `collect`: `RolloutCollector`, sampling + grading + packing into a `RolloutBatch`;
- `scorer`: `BatchScorer`, the reference / old log-probs and the anchor's log Z;
- `objectives`: one frozen class per method (`Disa`, `FlowRL`, `Grpo`, `Gspo`), with its
  hyperparameters and declared needs, on the pure loss functions of `losses` (eqs. 1-3, 5, 6, 10);
- `update`: `PolicyUpdater`, the jitted sharded micro-batched AdamW update of `train_step`, and
  the weight sync to the engine;
- `trainer`: the loop, validation, checkpoints and resume.

Also: `batch` (the typed batches), `prompts` (the resumable prompt stream), `replay` (Stage 1
replay), `logz_head` (FlowRL's head), `config` (what the trainer reads), `metrics` (JSONL +
TensorBoard). Sub-modules are imported on use (``from disa_jax.rl import objectives``) so that
importing the package stays cheap.
"""
