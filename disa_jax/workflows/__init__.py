"""Real-checkpoint workflows: the Stage 1, Stage 2 and evaluation commands behind `launch/`.

- `typed_config`: ConfigDict -> frozen dataclass conversion with field-named errors.
- `prompting`: rendering and tokenising prompt records per model, tokenizer compatibility, and the
  engine adapter that lets the proposal see prompts in its own chat format.
- `stage1`: `Stage1Config`, `run_stage1` (sample -> grade -> score under pi_ref -> resumable
  dataset) and `stage1_summary`.
- `stage2`: `Stage2Config`, `run_stage2` (reference embeddings -> anchor fit -> curve, summary,
  frozen anchor).
- `evaluation`: `EvalConfig`, `run_evaluation` (checkpoint x benchmark suite -> tables).
- `export`: `export_policy` (a Stage 3 checkpoint -> an HF directory).

Import the submodules explicitly (`from disa_jax.workflows import stage1`); each pulls in JAX,
transformers and the engines only when it is imported.
"""
