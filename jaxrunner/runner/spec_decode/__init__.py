"""Speculative decoding on the device: the ``Drafter`` protocol and its proposers (a draft model, an EAGLE head)."""
