"""Stage 2 (offline): the prompt-conditioned regressor g_psi fitted to Stage 1 labels, then frozen."""
from disa_jax.anchor.fit import AnchorFitConfig, FitResult, fit_anchor
from disa_jax.anchor.frozen import Anchor, AnchorMeta, EmbeddingSpec
from disa_jax.anchor.mlp import AnchorMLP

__all__ = ["Anchor", "AnchorMeta", "EmbeddingSpec", "AnchorMLP", "AnchorFitConfig", "FitResult", "fit_anchor"]
