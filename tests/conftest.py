"""Test-wide settings."""

import os

import torch
from hypothesis import settings

# Without a CUDA device, Triton kernels run in Triton's CPU interpreter. The variable must
# be set before anything first imports Triton, and modules of any folder may (transformers
# does), so it is set here, before pytest collects a single test. An explicit setting wins.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# CI (which sets CI=true) replays a fixed sequence of examples, so a property test cannot
# turn a submission red by the luck of the draw; local runs keep exploring new examples.
# Failures found locally are pinned with @example.
settings.register_profile("ci", derandomize=True, deadline=None)
# The fuzz campaign (tests/router/test_fuzz_*.py, `python -m bench.fuzz`): many more examples
# per property test, FUZZ_EXAMPLES of them (default 2000).
settings.register_profile(
    "campaign", deadline=None, max_examples=int(os.environ.get("FUZZ_EXAMPLES", 2000))
)
if os.environ.get("CI"):
    settings.load_profile("ci")
if os.environ.get("HYPOTHESIS_PROFILE"):
    settings.load_profile(os.environ["HYPOTHESIS_PROFILE"])
