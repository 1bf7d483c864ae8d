"""What the router and the workers agree on: sampling parameters, logprobs, prefix-block
hashes and the msgpack wire messages between them.

May import: the standard library and msgpack only; nothing else of `workers/`, and never
torch, so that the router process (which imports this package) does not load torch.
"""
