"""Supervised fine-tuning: the warm-up of the main job's models and the LoRA-SFT baseline (App. C.4)."""
from disa_jax.sft.supervised import SFTConfig, make_sft_step, sft_loss

__all__ = ["SFTConfig", "make_sft_step", "sft_loss"]
