"""Helpers of the sampler (`workers/sampler.py`)."""
