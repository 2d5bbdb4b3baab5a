"""Teacher-forced scoring: chunked per-token log-probs, sequence log-probs, prompt embeddings,
on padded batches or packed rows (`disa_jax.data.packing`)."""

from disa_jax.scoring.logprobs import (DEFAULT_CHUNK_SIZE, UNCHUNKED_MAX_ELEMENTS,
                                       branch_predictors, default_chunk_rows, gather_responses,
                                       logprobs_from_hidden, packed_prompt_embeddings,
                                       packed_token_logprobs, prompt_embeddings, segment_mean,
                                       sequence_logprob, token_logprobs, token_logprobs_naive)

__all__ = ["DEFAULT_CHUNK_SIZE", "UNCHUNKED_MAX_ELEMENTS", "branch_predictors",
           "default_chunk_rows", "gather_responses", "logprobs_from_hidden",
           "packed_prompt_embeddings", "packed_token_logprobs", "prompt_embeddings",
           "segment_mean", "sequence_logprob", "token_logprobs", "token_logprobs_naive"]
