"""Stage 2 (offline): the prompt-conditioned regressor g_psi fitted to Stage 1 labels, then frozen."""
from disa_jax.anchor.fit import AnchorFitConfig, FitResult, fit_anchor, fit_anchor_many
from disa_jax.anchor.frozen import Anchor, AnchorMeta, EmbeddingSpec
from disa_jax.anchor.labels import LABEL_VARIANTS, WEIGHTINGS, anchor_targets, targets_from_log_weights
from disa_jax.anchor.mlp import AnchorMLP
from disa_jax.anchor.noise import noise_offsets, noisy_log_z
from disa_jax.anchor.table import TableAnchor, load_anchor

__all__ = ["Anchor", "TableAnchor", "load_anchor", "AnchorMeta", "EmbeddingSpec", "AnchorMLP", "AnchorFitConfig", "FitResult", "fit_anchor",
           "fit_anchor_many", "noise_offsets", "noisy_log_z", "LABEL_VARIANTS", "WEIGHTINGS", "anchor_targets", "targets_from_log_weights"]
