"""Sampling on the device: the logits pipeline, seeded Gumbel noise, top-k/top-p, logprobs."""
