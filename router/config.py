"""The router's settings (resolved by ``cluster/`` at bring-up)."""

from __future__ import annotations

from dataclasses import dataclass, field

from router.policy import KVWeights


@dataclass(frozen=True)
class RouterConfig:
    model_name: str
    architecture: str
    dtype: str
    max_model_len: int
    vocab_size: int
    block_size: int
    policy: str = "kv_aware"
    disaggregation: str = "auto"
    auto_local_prefill_tokens: int = 256
    saturated_queue: int = 8
    max_queued_requests: int = 1024
    # Per caller (router/quotas.py): its share of max_queued_requests, and its request
    # rate (0 = none) with a burst.
    max_queued_share_per_key: float = 1.0
    requests_per_second_per_key: float = 0.0
    request_burst_per_key: int = 16
    migration_limit: int = 3  # per request (router/migration.py); 0 = never migrate
    # Live scaling (router/scaling.py): how long a draining worker's requests may take
    # before they migrate, and the most workers of both pools (0 = the cluster's room).
    scale_down_grace_s: float = 30.0
    scale_max_replicas: int = 0
    # Server-side deadlines (router/lifecycle.py): the whole request, and the longest wait
    # for its next event from a worker; 0 = none.
    request_timeout_s: float = 0.0
    request_idle_timeout_s: float = 0.0
    kv_transfer_backend: str = "nixl"
    speculative: str = ""  # the decode pool's speculative decoding, for status; "" = off
    kv_weights: KVWeights = field(default_factory=KVWeights)  # kv_aware's constants
    # Peer pull (G4, router/peer_prefix.py): kv_cache.peer_sharing; pull a prefix another
    # worker holds when it is at least peer_min_blocks longer than the target's own
    # (router.peer_min_blocks, router.peer_export_timeout_seconds in the config).
    peer_sharing: bool = False
    peer_min_blocks: int = 4
    peer_export_timeout_s: float = 5.0
    # kv_transfer.allow_fault_injection with $BATON_KV_FAULTS set: the workers' transfers
    # fail on purpose (testing); /health and `baton status` say so.
    fault_injection: bool = False
