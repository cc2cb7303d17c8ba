"""Target models: the LLMs that DFlash drafts for (functional JAX, params as pytrees)."""
