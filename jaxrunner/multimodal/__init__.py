"""Multimodal inputs: images read, preprocessed and hashed on the host, their placeholder spans in the prompt."""
