"""Stage 3: anchored trajectory-balance RL (DISA) and the FlowRL, GRPO and GSPO baselines.

- `losses`: the four objectives as pure jittable functions (eqs. 1-4, 8).
- `logz_head`: FlowRL's co-trained log Z_phi head (kept apart from the policy).
- `train_step`: the jitted, sharded, micro-batched AdamW update.
- `trainer`: the rollout -> reward -> update -> sync -> eval -> checkpoint loop.
- `config`: typed, validated run configuration; `metrics`: JSONL + TensorBoard logging.

Sub-modules are imported on use (``from disa_jax.rl import losses``) so that importing the package
stays cheap.
"""
