"""The cluster config's ``router`` section: the front ends, the routing policy and its
weights, admission and recovery. Its own module because it is the one section with no
engine settings and most of the keys (``cluster/config.py`` holds the rest)."""

from __future__ import annotations

import os
import sys
from typing import Literal

from pydantic import model_validator

from cluster.config_schema import ConfigSection, option
from router.tls import TlsFiles


class RouterSection(ConfigSection):
    host: str = option("127.0.0.1", "gRPC and HTTP listen address (loopback unless configured)")
    port: int = option(50051, "gRPC listen port; 0 = any free port", ge=0, le=65535)
    http_port: int = option(
        8000,
        "OpenAI-compatible HTTP API port (/v1/completions, /v1/chat/completions); 0 = no HTTP",
        ge=0,
        le=65535,
    )
    processes: int = option(
        1,
        "Router processes serving the same gRPC and HTTP ports (SO_REUSEPORT, Linux) and "
        "the same workers, for front-end CPU (docs/serving.md, 'Several router processes'); "
        "at most the host's cores",
        ge=1,
        le=64,
    )
    api_key: str | None = option(
        None,
        "One API key (named default) that HTTP /v1 and gRPC calls need; prefer "
        "api_keys_file or $BATON_API_KEYS (a config file is no secret store); unset = none",
    )
    api_keys_file: str | None = option(
        None,
        "YAML file of API keys (keys: [{name, key, tenant}]), a mounted Secret say: with "
        "api_key and $BATON_API_KEYS / $BATON_API_KEY, the keys both front ends require "
        "(docs/security.md); none at all = the front ends are open",
    )
    admin_key_file: str | None = option(
        None,
        "File holding the admin key (>= 16 characters) that the HTTP admin routes "
        "(/admin/scale: baton scale) require as a bearer token; or $BATON_ADMIN_KEY; "
        "unset = the admin routes answer 403",
    )
    tls_cert_file: str | None = option(
        None, "PEM certificate (chain) gRPC and HTTP serve TLS with; unset = plaintext"
    )
    tls_key_file: str | None = option(None, "PEM private key of tls_cert_file")
    tls_client_ca_file: str | None = option(
        None, "PEM CA bundle: with it, clients must present a certificate it signed (mTLS)"
    )
    event_channel_tls: Literal["auto", "on", "off"] = option(
        "auto",
        "TLS 1.3 on the workers' event channels to the router, with a certificate the router "
        "makes at start and the workers pin: auto = when the channel leaves the host "
        "(workers on other Ray nodes)",
    )
    reserved_cpus: int = option(
        1,
        "CPU cores left to the router process (HTTP, gRPC, tokenizing) when Baton starts a "
        "local Ray instance: the workers' torch threads share the others (vLLM's "
        "VLLM_CPU_NUM_OF_RESERVED_CPU; measured in bench/RESULTS.md)",
        ge=0,
    )
    policy: Literal["round_robin", "least_loaded", "kv_aware"] = option(
        "kv_aware", "How a worker is chosen for a request"
    )
    disaggregation: Literal["always", "never", "auto"] = option(
        "auto", "auto = prefill on the decode worker when short, cached or prefill is saturated"
    )
    auto_local_prefill_tokens: int = option(
        256, "auto: prefill locally when at most this many prompt tokens are uncached", ge=0
    )
    auto_saturated_queue: int = option(
        8, "auto: also prefill locally when every prefill worker has this many waiting", ge=1
    )
    kv_overlap_weight: float = option(
        2.0,
        "kv_aware: cost of a prompt block to compute against a KV block in use (cost = this "
        "x prefill blocks + decode blocks; Dynamo's overlap_score_weight; measured in "
        "bench/RESULTS.md)",
        ge=0.0,
    )
    kv_balance_abs_requests: int = option(
        4,
        "kv_aware: load wins over cache hits when the most loaded worker has more than this "
        "many requests over the least loaded ...",
        ge=0,
    )
    kv_balance_rel: float = option(
        1.5, "... and more than this times the least loaded's (SGLang's balance test)", ge=1.0
    )
    kv_host_tier_weight: float = option(
        0.1,
        "kv_aware: cost of a prompt block onboarded from a worker's host-memory tier (G2), "
        "as a share of computing it (docs/kv-tiers.md)",
        ge=0.0,
    )
    kv_disk_tier_weight: float = option(
        0.5,
        "kv_aware: cost of a prompt block onboarded from a worker's disk tier (G3), as a "
        "share of computing it",
        ge=0.0,
    )
    kv_receive_weight: float = option(
        0.1,
        "kv_aware: cost of a prompt block a decode worker fed by a prefill worker lacks and "
        "must receive, as a share of computing it (the blocks it holds are not received)",
        ge=0.0,
    )
    # Peer pull (G4, kv_cache.peer_sharing; router/peer_prefix.py): the router's decisions.
    peer_min_blocks: int = option(
        4,
        "kv_cache.peer_sharing: pull a prompt's prefix from another worker only when it holds "
        "at least this many blocks more of it than the worker that computes the prompt",
        ge=1,
    )
    peer_export_timeout_seconds: float = option(
        5.0,
        "kv_cache.peer_sharing: how long the request waits for the other worker to lease "
        "the prefix; past it, the prefix is recomputed",
        gt=0.0,
    )
    max_queued_requests: int = option(
        1024, "Requests admitted but not finished; beyond: RESOURCE_EXHAUSTED", ge=1
    )
    max_queued_share_per_key: float = option(
        1.0,
        "Share of max_queued_requests one API key may hold (docs/security.md); beyond: "
        "RESOURCE_EXHAUSTED / 429 for that key only; 1 = no bound of its own",
        gt=0.0,
        le=1.0,
    )
    requests_per_second_per_key: float = option(
        0.0,
        "Requests per second one API key (every caller, without keys) may start, with a "
        "burst of request_burst_per_key; beyond: 429 with Retry-After; 0 = no rate limit",
        ge=0.0,
    )
    request_burst_per_key: int = option(
        16, "Requests a key may start at once beyond its rate", ge=1
    )
    migration_limit: int = option(
        3,
        "Times a request may move to another worker when its worker dies mid-request "
        "(its stream continues there); 0 = fail such requests with UNAVAILABLE",
        ge=0,
    )
    request_timeout_seconds: float = option(
        0.0,
        "Longest a request may take, arrival to its last token; past it: ended everywhere "
        "(its blocks freed) with DEADLINE_EXCEEDED / HTTP 504; 0 = no limit",
        ge=0.0,
    )
    request_idle_timeout_seconds: float = option(
        0.0,
        "Longest wait for a request's next output from its worker (a worker that lost it "
        "holds it forever otherwise); past it: DEADLINE_EXCEEDED / 504; 0 = no limit",
        ge=0.0,
    )
    drain_grace_seconds: float = option(
        30.0, "On SIGTERM, how long in-flight requests may take to finish", ge=0.0
    )
    scale_down_grace_seconds: float = option(
        30.0,
        "Live scaling (baton scale): how long a worker being removed may take to finish its "
        "requests; past it they migrate to other workers with their tokens",
        ge=0.0,
    )
    scale_max_replicas: int = option(
        0,
        "Live scaling: most workers of both pools together; a local Ray instance Baton "
        "starts gets CPUs for that many; 0 = what the cluster has room for",
        ge=0,
    )
    restart_attempts: int = option(
        4, "Attempts to restart a dead worker's replica; 0 = leave it out of routing", ge=0
    )
    restart_backoff_seconds: float = option(
        1.0, "Wait before the second restart attempt; doubles after each failure", gt=0.0
    )
    restart_max_backoff_seconds: float = option(
        30.0, "Longest wait between restart attempts", gt=0.0
    )

    @model_validator(mode="after")
    def _check_processes(self) -> RouterSection:
        if self.processes > 1 and not sys.platform.startswith("linux"):
            # Elsewhere SO_REUSEPORT does not spread connections: one process would get them.
            raise ValueError(f"processes: {self.processes} needs Linux (SO_REUSEPORT)")
        cores = os.cpu_count() or 1
        if self.processes > cores:
            raise ValueError(
                f"processes: {self.processes} is more than this host's {cores} cores "
                "(a router process is worth one core at most)"
            )
        return self

    @model_validator(mode="after")
    def _check_tls(self) -> RouterSection:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file: set both (TLS) or neither")
        if self.tls_client_ca_file is not None and self.tls_cert_file is None:
            raise ValueError("tls_client_ca_file: client certificates need TLS (tls_cert_file)")
        return self

    def tls(self) -> TlsFiles | None:
        """The front ends' TLS files; None: plaintext."""
        if self.tls_cert_file is None or self.tls_key_file is None:
            return None
        return TlsFiles(self.tls_cert_file, self.tls_key_file, self.tls_client_ca_file)
