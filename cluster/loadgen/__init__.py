"""``baton bench``: a gRPC load generator that measures a running router the way
``vllm bench serve`` does (TTFT, TPOT, ITL, E2E, throughput, goodput)."""
