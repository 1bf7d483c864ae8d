"""Engine settings: one frozen dataclass, validated once, "auto" resolved at start-up.

:class:`EngineConfig` is the single declaration of every engine setting: its type, its
default, its one-line doc and its bounds. The cluster config's sections take the same
field, default, doc and bounds from here (``cluster/config.py``: ``engine_option``), the
worker spec carries an ``EngineConfig`` as it is, and docs/config.md and the Helm values
schema are generated from both. Adding a setting: a field here, a line in the cluster
section it belongs to (if the cluster config sets it), and the regenerated docs.

This module is imported by the driver and the router: no torch at import.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import torch

Dtype = Literal["auto", "float32", "float16", "bfloat16"]
KVCacheDtype = Literal["auto", "fp8_e4m3"]
SpeculativeMethod = Literal["ngram", "draft"]
Quantization = Literal["none", "fp8", "int4"]  # workers/models/quant/formats.py QUANTIZATIONS
OnboardMode = Literal["off", "auto", "on"]  # workers/engine/kv_tiers/layer_onboard.py
ExpertDispatch = Literal["allreduce", "alltoall"]  # workers/models/expert_parallel.py


def setting(
    default: Any,
    doc: str,
    *,
    ge: float | None = None,
    le: float | None = None,
    gt: float | None = None,
) -> Any:
    """An engine setting: its default, its one-line doc and its numeric bounds.

    The metadata keys are the arguments of ``cluster.config_schema.option``, which the
    YAML edge's field is built with, so it checks the same bounds and renders the same doc
    (workers/ may not import cluster/).
    """
    meta = {"doc": doc, "ge": ge, "le": le, "gt": gt, "lt": None}
    return dataclasses.field(default=default, metadata=meta)


@dataclass(frozen=True)
class EngineConfig:
    # The model directory is resolved per worker (cluster/model_source.py), not a setting.
    model: str = dataclasses.field(
        metadata={"doc": "Hugging Face model directory (config.json, *.safetensors, tokenizer)"}
    )
    dtype: Dtype = setting("auto", "Weights and KV dtype; auto = bfloat16 on GPU, float32 on CPU")
    # A quantized checkpoint (config.json quantization_config) is read in its own layout
    # whatever this says; a different method is refused (docs/quantization.md).
    quantization: Quantization = setting(
        "none", "Weights: none = as stored; fp8 or int4 = quantize a plain checkpoint on load"
    )
    # cpu | cuda | cuda:N; the cluster config narrows it to auto | cpu | cuda (Ray picks the GPU).
    device: str = setting("auto", "Where the engine runs; auto = CUDA when the node has a GPU")
    max_model_len: int | None = setting(
        None, "Longest prompt + output in tokens; unset = the model's own limit", ge=2
    )
    block_size: int = setting(16, "Tokens per KV-cache block", ge=1, le=1024)
    # Sized from memory: at most what 2 * max_num_seqs full-length requests need.
    num_kv_blocks: int | None = setting(
        None, "KV-cache blocks per worker; unset = sized from memory", ge=1
    )
    # Batch-invariant kernels (kernels/batch_invariant.py): a sequence's logits do not
    # depend on its batch, chunking, cache hits or worker; CPU only, docs/engine.md.
    deterministic: bool = setting(
        False, "Bitwise-reproducible logits whatever batch, chunk, cache or worker computed them"
    )
    # FP8: float8_e4m3fn values with a float32 scale per token and kv head, derived as the
    # KV is written (or a checkpoint's static k_scale/v_scale); docs/kv-cache-layout.md.
    kv_cache_dtype: KVCacheDtype = setting(
        "auto", "KV-cache storage: auto = the model dtype, fp8_e4m3 = FP8 with per-token scales"
    )
    kv_cache_memory_gib: float = setting(2.0, "KV-cache size per worker on CPU", gt=0.0)
    gpu_memory_fraction: float = setting(
        0.90, "Share of GPU memory for weights + KV cache", gt=0.0, le=1.0
    )
    # KV tiers below the pool (docs/kv-tiers.md): blocks the pool evicts are written down
    # instead of dropped, and a prefix lookup consults the pool, host memory, disk, peers.
    kv_host_tier_gib: float = setting(
        0.0, "Host-memory KV tier (G2) per worker, GiB; 0 = off (pinned on CUDA)", ge=0.0
    )
    kv_disk_tier_path: str | None = setting(
        None, "Directory of the disk KV tier (G3), one per worker; unset = off"
    )
    kv_disk_tier_gib: float = setting(16.0, "Most disk the KV tier (G3) may use, GiB", gt=0.0)
    kv_disk_tier_secret_file: str | None = setting(
        None,
        "File holding the deployment's secret (>= 16 bytes): disk-tier blocks are MAC'd "
        "with it and a forged or copied one is refused; unset = checksums only "
        "(docs/security.md)",
    )
    kv_tier_onboard: OnboardMode = setting(
        "off",
        "KV tiers: onboard a prefix hit layer group by layer group while the first chunk "
        "computes: off (synchronous, at admission), on, or auto (a disk hit, or a host hit "
        "of 64+ blocks); off by default until measured on an accelerator (docs/kv-tiers.md)",
    )
    kv_peer_sharing: bool = setting(
        False, "Pull prefixes other workers hold (G4) over NIXL instead of recomputing"
    )
    # Mixture-of-Experts models (docs/moe.md): attention stays tensor-parallel over the
    # replica's ranks, and the experts are split among the same ranks (whole experts per
    # rank) instead of every expert being split across them.
    expert_parallel: int = setting(
        1,
        "MoE models: ranks the experts are sharded over; 1 = off, else the replica's "
        "tensor_parallel",
        ge=1,
    )
    expert_dispatch: ExpertDispatch = setting(
        "allreduce",
        "MoE with expert_parallel: allreduce (each rank its experts over all tokens, one "
        "all-reduce) or alltoall (token slices sent to the experts' ranks and back)",
    )
    # The expert placement rebalancer (docs/moe.md, "Rebalancer"): copies of hot experts
    # in spare slots, swapped in one layer per step while the replica keeps serving.
    expert_rebalance_steps: int = setting(
        0,
        "MoE with expert_parallel: replan the spare expert slots every this many steps "
        "from the expert load since the last plan; 0 = off",
        ge=0,
    )
    expert_redundant: int = setting(
        1, "Spare expert slots per rank the rebalancer fills (used when it is on)", ge=1
    )
    max_num_seqs: int = setting(64, "Most requests running at once on a replica", ge=1)
    # Longer prompts are prefilled in chunks of at most this many tokens.
    max_num_batched_tokens: int = setting(2048, "Token budget of one engine step", ge=1)
    # workers/engine/decode_graphs.py: buckets 1, 2, 4, 8, 16, ... up to this (or max_num_seqs).
    cuda_graph_max_batch: int = setting(
        64, "Decode steps of up to this many requests replay CUDA graphs (CUDA, one rank); 0 = eager",
        ge=0,
    )  # fmt: skip
    enable_prefix_caching: bool = setting(True, "Reuse KV blocks of identical prompt prefixes")
    seed: int = setting(
        0, "Seed of the shared sampling generator (requests with their own seed use theirs)"
    )
    detokenize: bool = setting(
        True, "Detokenize and match stop strings here; False when the router does both"
    )
    # Speculative decoding (docs/engine.md, "Speculative decoding"): greedy output is
    # unchanged token for token, sampled output keeps the target's distribution.
    speculative_method: SpeculativeMethod | None = setting(
        None, "Speculative decoding: ngram (prompt lookup) or draft (a draft model); unset = off"
    )
    speculative_num_tokens: int = setting(
        4, "Tokens proposed per speculative step (k), verified in one target forward", ge=1, le=16
    )
    speculative_draft_model: str | None = setting(
        None, "Draft model directory (same tokenizer as the target); required for draft"
    )
    speculative_ngram_max: int = setting(
        4, "Longest n-gram (output suffix) the prompt lookup matches", ge=1, le=64
    )
    speculative_ngram_min: int = setting(
        2, "Shortest n-gram (output suffix) the prompt lookup matches", ge=1, le=64
    )
    # Below it, the engine measures what speculating costs per batch size and lets each
    # request speculate while its acceptance pays for that (workers/engine/speculative/gate.py).
    speculative_max_batch_size: int = setting(
        32, "A step with more running decodes than this does not speculate", ge=1
    )

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            _check(f.name, getattr(self, f.name), _HINTS[f.name], f.metadata)
        if self.max_num_batched_tokens < self.max_num_seqs:
            # Every running request needs a token each step; a smaller budget would starve
            # the requests at the end of the running list.
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({self.max_num_seqs})"
            )
        self._check_speculative()
        if self.expert_rebalance_steps and self.expert_parallel == 1:
            raise ValueError(
                "expert_rebalance_steps: needs expert_parallel > 1 (one rank holds every "
                "expert: there is no rank load to balance); set it to 0"
            )

    def _check_speculative(self) -> None:
        if self.speculative_ngram_min > self.speculative_ngram_max:
            raise ValueError(
                f"speculative_ngram_min ({self.speculative_ngram_min}) must be <= "
                f"speculative_ngram_max ({self.speculative_ngram_max})"
            )
        if self.speculative_method == "draft" and not self.speculative_draft_model:
            raise ValueError("speculative_draft_model: required when speculative_method is draft")
        if self.speculative_method != "draft" and self.speculative_draft_model is not None:
            raise ValueError(
                "speculative_draft_model: set only with speculative_method: draft, "
                f"got speculative_method={self.speculative_method!r}"
            )

    def resolve_device(self) -> torch.device:
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        try:
            return torch.device(self.device)
        except RuntimeError as exc:
            raise ValueError(f"device: {exc}") from None

    def resolve_dtype(self, device: torch.device) -> torch.dtype:
        import torch

        if self.dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return getattr(torch, self.dtype)


_HINTS = typing.get_type_hints(EngineConfig)


def _check(name: str, value: Any, tp: Any, meta: typing.Mapping[str, Any]) -> None:
    """One field against its declared type and bounds; messages as the YAML edge words them."""
    args = typing.get_args(tp)
    if type(None) in args:  # X | None: None means "derive it"
        if value is None:
            return
        tp = next(a for a in args if a is not type(None))
    if typing.get_origin(tp) is Literal:
        if value not in typing.get_args(tp):
            choices = ", ".join(typing.get_args(tp))
            raise ValueError(f"{name}: must be one of {choices}; got {value!r}")
        return
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int and (not is_number or not isinstance(value, int)):
        raise ValueError(f"{name}: expected an integer, got {type(value).__name__} {value!r}")
    if tp is float and not is_number:
        raise ValueError(f"{name}: expected a number, got {type(value).__name__} {value!r}")
    for key, ok, sign in (
        ("ge", lambda b: value >= b, ">="),
        ("gt", lambda b: value > b, ">"),
        ("le", lambda b: value <= b, "<="),
    ):
        bound = meta.get(key)
        if bound is not None and not ok(bound):
            raise ValueError(f"{name}: must be {sign} {bound}, got {value}")


def check_expert_parallel(config: EngineConfig, tp_size: int) -> None:
    """Refuse ``expert_parallel`` other than 1 or the replica's tensor-parallel size: the
    experts are sharded over the ranks attention is split over (docs/moe.md). Whether the
    model has experts at all is checked when it loads."""
    if config.expert_parallel not in (1, tp_size):
        raise ValueError(
            f"expert_parallel: must be 1 (off) or the replica's tensor_parallel ({tp_size}), "
            f"got {config.expert_parallel}"
        )
