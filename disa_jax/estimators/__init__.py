"""Stage 1 (offline): importance-sampling labels log Z_IS(q) and their diagnostics.

Public API (notebooks and external scripts import these names; keep them):
`log_importance_weights`, `log_z_is`, `log_z_gm`, `effective_sample_size`, `cv_squared`.
"""
from disa_jax.estimators.dataset import (Stage1Data, Stage1FormatError, Stage1Writer, build_records,
                                         load_stage1, scaled_logps)
from disa_jax.estimators.importance import (cv_squared, effective_sample_size, jackknife_log_z,
                                            jensen_corrected_log_z,
                                            log_importance_weights, log_z_gm, log_z_is, max_weight_share,
                                            stage1_statistics)
from disa_jax.estimators.nstudy import (NStudyResult, elbow_k, kmeans, n_study, sse_curve,
                                        stratified_subset, subsample_log_z)
from disa_jax.estimators.reward_transforms import RewardTransform, transform_rewards

__all__ = [
    "log_importance_weights", "log_z_is", "log_z_gm", "effective_sample_size", "cv_squared",
    "max_weight_share", "stage1_statistics", "jensen_corrected_log_z", "jackknife_log_z", "RewardTransform",
    "transform_rewards", "n_study", "NStudyResult", "subsample_log_z", "kmeans", "sse_curve", "elbow_k",
    "stratified_subset", "Stage1Writer", "Stage1Data", "Stage1FormatError", "build_records", "load_stage1",
    "scaled_logps",
]
