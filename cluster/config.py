"""The cluster config (DESIGN §2.2): YAML in, frozen dataclasses out, validated once.

Every field has a default and a one-line doc; unknown keys and bad values are refused at
load time with the key path in the message (``router.port: must be <= 65535, got 70000``).
``json_schema()`` renders the same definitions for the Helm chart's values schema.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from cluster.config_schema import ConfigError, json_schema, load_section, option, section


@dataclass(frozen=True)
class ModelSection:
    path: str | None = option(
        None, "Hugging Face model directory; unset = a small random model made on first use"
    )
    name: str | None = option(None, "Served model name; unset = the directory's name")
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = option(
        "auto", "Weights and KV dtype; auto = bfloat16 on GPU, float32 on CPU"
    )
    max_model_len: int | None = option(
        None, "Longest prompt + output in tokens; unset = the model's own limit", ge=2
    )


@dataclass(frozen=True)
class PoolSection:
    replicas: int = option(1, "Worker replicas in this pool", ge=0)
    tensor_parallel: int = option(
        1, "Tensor-parallel ranks per pipeline stage (one process each, on one node)", ge=1
    )
    pipeline_parallel: int = option(
        1,
        "Pipeline stages per replica, each with its share of the layers (at most one per "
        "layer); a stage's tensor_parallel ranks share one node, the stages share one "
        "when it has room, else they span nodes",
        ge=1,
    )
    max_num_batched_tokens: int = option(2048, "Token budget of one engine step", ge=1)
    max_num_seqs: int = option(64, "Most requests running at once on a replica", ge=1)
    device: Literal["auto", "cpu", "cuda"] = option(
        "auto", "Where the workers run; auto = CUDA when the node has a GPU"
    )
    node_resource: str | None = option(
        None,
        "Ray resource each rank of this pool takes one unit of (pins the pool to the nodes "
        "that offer it; the Helm chart sets it); unset = any node",
    )


@dataclass(frozen=True)
class KVCacheSection:
    block_size: int = option(16, "Tokens per KV-cache block", ge=1, le=1024)
    gpu_memory_fraction: float = option(
        0.90, "Share of GPU memory for weights + KV cache", gt=0.0, le=1.0
    )
    num_blocks: int | None = option(
        None, "KV-cache blocks per worker; unset = sized from memory", ge=1
    )
    cpu_memory_gib: float = option(2.0, "KV-cache size per worker on CPU", gt=0.0)
    enable_prefix_caching: bool = option(True, "Reuse KV blocks of identical prompt prefixes")


@dataclass(frozen=True)
class KVTransferSection:
    backend: Literal["nixl", "local"] = option(
        "nixl", "How KV blocks move from prefill to decode; local = in-process (tests)"
    )
    direction: Literal["auto", "pull", "push"] = option(
        "auto", "pull = decode reads, push = prefill writes; auto = the faster for the transport"
    )
    lease_seconds: float = option(
        30.0, "Prefill frees KV blocks not pulled within this time", gt=0.0
    )
    timeout_seconds: float = option(10.0, "Deadline of one request's KV transfer", gt=0.0)
    on_failure: Literal["recompute", "fail"] = option(
        "recompute", "A failed transfer: recompute the prompt on decode, or fail the request"
    )


@dataclass(frozen=True)
class RouterSection:
    host: str = option("127.0.0.1", "gRPC listen address (loopback unless configured)")
    port: int = option(50051, "gRPC listen port; 0 = any free port", ge=0, le=65535)
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
    max_queued_requests: int = option(
        1024, "Requests admitted but not finished; beyond: RESOURCE_EXHAUSTED", ge=1
    )
    drain_grace_seconds: float = option(
        30.0, "On SIGTERM, how long in-flight requests may take to finish", ge=0.0
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


@dataclass(frozen=True)
class MetricsSection:
    enabled: bool = option(True, "Serve Prometheus metrics (/metrics) on every node")
    host: str = option(
        "127.0.0.1", "Metrics listen address on each node (loopback unless configured)"
    )
    port: int = option(
        9400, "Metrics port on each node; 0 = any free port (logged)", ge=0, le=65535
    )


@dataclass(frozen=True)
class ClusterConfig:
    model: ModelSection = section(ModelSection, "The model to serve")
    prefill: PoolSection = section(PoolSection, "The prefill worker pool")
    decode: PoolSection = section(PoolSection, "The decode worker pool")
    kv_cache: KVCacheSection = section(KVCacheSection, "Paged KV cache of every worker")
    kv_transfer: KVTransferSection = section(KVTransferSection, "KV hand-off prefill -> decode")
    router: RouterSection = section(RouterSection, "The gRPC front end and routing")
    metrics: MetricsSection = section(MetricsSection, "Prometheus scrape endpoints")

    def __post_init__(self) -> None:
        if self.decode.replicas < 1:
            raise ValueError(f"decode.replicas: must be >= 1, got {self.decode.replicas}")
        if self.prefill.replicas < 1 and self.router.disaggregation != "never":
            raise ValueError(
                "prefill.replicas: 0 prefill workers needs router.disaggregation: never"
            )
        router = self.router
        if router.restart_max_backoff_seconds < router.restart_backoff_seconds:
            raise ValueError(
                f"router.restart_max_backoff_seconds ({router.restart_max_backoff_seconds}) "
                f"is below router.restart_backoff_seconds ({router.restart_backoff_seconds})"
            )


def parse_config(data: Any) -> ClusterConfig:
    """Validate parsed YAML (a mapping, or None for all defaults)."""
    return load_section(ClusterConfig, data)


def load_config(path: str | Path | None) -> ClusterConfig:
    """Read and validate a YAML config file; None = the embedded default."""
    if path is None:
        return ClusterConfig()
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    try:
        return parse_config(data)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def config_json_schema() -> dict[str, Any]:
    """JSON Schema of the whole config (the Helm chart's values embed it)."""
    schema = json_schema(ClusterConfig)
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "Baton cluster config"
    return schema
