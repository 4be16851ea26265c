"""vLLM model classes with attention-FFN disaggregation (import only inside vLLM)."""
