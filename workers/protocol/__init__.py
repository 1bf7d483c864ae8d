"""What the router and the workers agree on: sampling parameters (structured-output
constraints included), logprobs, prefix-block hashes, the msgpack wire messages between
them and the metric names both record.

May import: the standard library, msgpack, msgspec, prometheus-client and llguidance (the
structured-output check, which needs no model) only; nothing else of `workers/`, and never
torch, so that the router process (which imports this package) does not load torch
(tests/router/test_torch_free.py).
"""
