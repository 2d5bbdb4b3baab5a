"""Teacher-forced scoring: chunked per-token log-probs, sequence log-probs, prompt embeddings."""

from disa_jax.scoring.logprobs import (DEFAULT_CHUNK_SIZE, UNCHUNKED_MAX_ELEMENTS,
                                       default_chunk_rows, logprobs_from_hidden, prompt_embeddings,
                                       sequence_logprob, token_logprobs, token_logprobs_naive)

__all__ = ["DEFAULT_CHUNK_SIZE", "UNCHUNKED_MAX_ELEMENTS", "default_chunk_rows",
           "logprobs_from_hidden", "prompt_embeddings", "sequence_logprob", "token_logprobs",
           "token_logprobs_naive"]
