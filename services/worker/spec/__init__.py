"""Speculative decoding: draft proposers (n-gram, draft model), the rejection sampler that
keeps the target's output distribution, and the bookkeeping of one verify step."""
