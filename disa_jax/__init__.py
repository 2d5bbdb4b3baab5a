"""disa_jax: DISA (Decoupled Importance-Sampled Anchoring) in JAX.

The packages follow the paper's data flow:

- Stage 1 (offline importance sampling of log Z):   `disa_jax.estimators`
- Stage 2 (frozen prompt-conditioned anchor g_psi): `disa_jax.anchor`
- Stage 3 (anchored trajectory-balance RL):         `disa_jax.rl`

and the parts every stage uses: `models` (Flax decoders, HF interop), `parallel` (mesh and sharding
rules), `scoring` (teacher-forced log-probs), `rollout` (generation process, JAX sampler, vLLM),
`rewards` (math / code verifiers), `data` (prompt datasets, synthetic tasks), `eval` (metrics),
`checkpoint` (orbax), `sft` (LoRA-SFT baseline).

Sub-packages are imported lazily so that `import disa_jax` stays cheap.
"""

__version__ = "0.1.0"
