"""jaxrunner: vLLM's V1 GPU model runner and offline engine in JAX/XLA."""
