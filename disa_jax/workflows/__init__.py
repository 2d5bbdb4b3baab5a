"""Real-checkpoint workflows: the Stage 1, Stage 2 and evaluation commands behind `launch/`.

- `typed_config`: ConfigDict -> frozen dataclass conversion with field-named errors.
- `prompting`: rendering and tokenising prompt records per model, tokenizer compatibility, and the
  engine adapter that lets the proposal see prompts in its own chat format.
- `stage1`: `Stage1Config`, `run_stage1` (sample -> grade -> score under pi_ref -> resumable
  dataset) and `stage1_summary`.
- `stage2`: `Stage2Config`, `run_stage2` (reference embeddings -> anchor fit -> curve, summary,
  frozen anchor).
- `stage3`: `Stage3Config`, `run_stage3` (RL from the backbone -> checkpoints, metrics, export).
- `sft`: `SftConfig`, `run_sft` (the LoRA-SFT baseline); `nstudy`: `run_nstudy` (App. C.3).
- `evaluation`: `EvalConfig`, `run_evaluation` (checkpoint x benchmark suite -> tables).
- `export`: `export_policy` (a Stage 3 checkpoint -> an HF directory).

Each ``run_*`` returns its stage's artifact, a frozen dataclass persisted next to its files that
loads itself (`disa_jax.artifacts`): `Stage1Result`, `AnchorArtifact`, `Stage3Run`, `SftRun`,
`EvalResult`, `NStudyResult` (``<Artifact>.load(dir)``; ``to_json()`` is what the command prints).
Later stages and the main job's report take these, not paths into another stage's directory.

Import the submodules explicitly (`from disa_jax.workflows import stage1`); each pulls in JAX,
transformers and the engines only when it is imported.
"""
