"""Orbax checkpointing of training runs (params, optimizer state, RNG, data position, step)."""
from disa_jax.checkpoint.manager import (CheckpointManager, CheckpointSaveError,
                                         CheckpointUnreadableError, array_to_rng, rng_to_array)

__all__ = ["CheckpointManager", "CheckpointSaveError", "CheckpointUnreadableError", "array_to_rng",
           "rng_to_array"]
