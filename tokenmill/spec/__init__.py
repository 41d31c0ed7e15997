"""Speculative decoding: proposers (prompt-lookup n-grams, a draft model) guess the next tokens, the target verifies
them all in one forward pass, and the rejection sampler keeps the target's distribution exactly."""
