"""Supervised fine-tuning: the warm-up of the main job's models and the LoRA-SFT baseline (App. D.4)."""
from disa_jax.sft.supervised import SupervisedSchedule, make_sft_step, sft_loss

__all__ = ["SupervisedSchedule", "make_sft_step", "sft_loss"]
