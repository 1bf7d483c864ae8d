"""Speculative decoding: proposers (n-gram prompt lookup, a draft model), the rejection
sampler that verifies their proposals against the target, and the counters."""
