"""Speculative decoding: proposers, verification and commit."""
