"""Evaluation: Mean@k, unbiased pass@k, maj@k, result tables, and diversity (judge + local metric).

- `metrics`: `mean_at_k`, `pass_at_k`, `pass_at_k_from_correct`, `maj_at_k`, `markdown_table`,
  `results_json`, `write_results`.
- `diversity`: `DiversityJudge` (App. D.5 prompt, OpenAI-compatible endpoint), `local_diversity`,
  `distinct_answers`, `mean_pairwise_distance`, `char_ngram_tfidf`.
- `runner` (import it explicitly: `from disa_jax.eval import runner`): `evaluate_benchmark`,
  `evaluate_suite`, `suite_table`, `eval_sampling_params` -- sampling with a rollout `Engine`.
"""

from disa_jax.eval import diversity
from disa_jax.eval import metrics
from disa_jax.eval.diversity import DiversityJudge
from disa_jax.eval.diversity import JudgeUnavailableError
from disa_jax.eval.diversity import local_diversity
from disa_jax.eval.metrics import maj_at_k
from disa_jax.eval.metrics import markdown_table
from disa_jax.eval.metrics import mean_at_k
from disa_jax.eval.metrics import pass_at_k
from disa_jax.eval.metrics import pass_at_k_from_correct
from disa_jax.eval.metrics import results_json
from disa_jax.eval.metrics import write_results

__all__ = ["diversity", "metrics", "DiversityJudge", "JudgeUnavailableError", "local_diversity",
           "maj_at_k", "markdown_table", "mean_at_k", "pass_at_k", "pass_at_k_from_correct",
           "results_json", "write_results"]
