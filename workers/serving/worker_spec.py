"""What a worker replica needs to start, and how each of its ranks builds its parts.

:class:`WorkerSpec` is built by ``cluster/`` from the cluster config and sent to every
rank's Ray actor as msgpack. :func:`build_engine` and :func:`connector_factory` are
shared by rank 0 (``workers/serving/ray_worker.py``) and the other ranks
(``workers/serving/ray_rank.py``), so that every rank's engine and KV connector agree.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import msgpack

from kvtransfer.backend import KVTransferConfig  # torch-free
from workers.engine.config import EngineConfig  # torch-free

if TYPE_CHECKING:  # the driver imports this module without torch
    from workers.engine.llm_engine import LLMEngine


@dataclass(frozen=True)
class WorkerSpec:
    """One replica: its engine settings as they are, and what is its own in the cluster."""

    name: str
    role: str  # prefill | decode
    model_id: str  # served name: part of the KV layout fingerprint
    engine: EngineConfig  # model = the resolved directory, device = cpu | cuda
    kv_transfer: KVTransferConfig = dataclasses.field(default_factory=KVTransferConfig)
    num_threads: int = 0  # torch intra-op threads on CPU; 0 = torch's default
    tensor_parallel: int = 1  # tensor-parallel ranks of each pipeline stage
    pipeline_parallel: int = 1  # pipeline stages of this replica
    dst_tensor_parallel: int = 1  # prefill: the decode pool's TP size (how many read a rank)
    dst_pipeline_parallel: int = 1  # prefill: the decode pool's stages (the same)
    metrics_dir: str = (
        ""  # this run's metrics root (workers/serving/metrics_node.py); "" = in memory
    )
    # decode.attention: data_parallel: this worker is rank dp_rank of a group of
    # data_parallel one-rank workers sharing the MoE experts (workers/parallel/dp_group.py),
    # meeting at the group's dp_rank 0; 1 = no group.
    data_parallel: int = 1
    dp_rank: int = 0
    dp_group: str = ""  # the group's name: its workers start and restart together

    def to_bytes(self) -> bytes:
        return msgpack.packb(dataclasses.asdict(self), use_bin_type=True)

    @classmethod
    def from_bytes(cls, data: bytes) -> WorkerSpec:
        fields = msgpack.unpackb(data, raw=False)
        return cls(
            **{
                **fields,
                "engine": EngineConfig(**fields["engine"]),
                "kv_transfer": KVTransferConfig(**fields["kv_transfer"]),
            }
        )

    @property
    def num_ranks(self) -> int:
        """Processes of this replica: every TP rank of every pipeline stage."""
        return self.tensor_parallel * self.pipeline_parallel

    def rank_name(self, rank: int) -> str:
        """The KV agent's worker id of one rank (rank 0 keeps the replica's name)."""
        return self.name if rank == 0 else f"{self.name}.rank{rank}"

    def engine_settings(self) -> EngineConfig:
        """The engine config this worker's engine runs with: the spec's, with token ids
        streamed (the router detokenizes) and the disk tier in this worker's own
        directory, ``<kv_disk_tier_path>/<name>``: a disk tier's directory belongs to one
        process, and a restarted worker keeps its name, so it finds its blocks again."""
        engine = dataclasses.replace(self.engine, detokenize=False)
        if engine.kv_disk_tier_path is not None:
            path = str(Path(engine.kv_disk_tier_path) / self.name)
            engine = dataclasses.replace(engine, kv_disk_tier_path=path)
        return engine


def build_engine(spec: WorkerSpec, parallel=None, before_forward=None, agree=None) -> LLMEngine:
    """This rank's engine: its shard of the weights, its heads of a cache of agreed size."""
    import torch

    from workers.engine.llm_engine import LLMEngine

    if spec.num_threads > 0:
        torch.set_num_threads(spec.num_threads)
    engine = LLMEngine(
        spec.engine_settings(),
        parallel=parallel,
        before_forward=before_forward,
        agree_num_blocks=agree,
    )
    if engine.device.type == "cpu":
        # The cache comes zeroed but unmapped (calloc): touch every page now, so the
        # first requests' KV transfers do not pay the page faults (they measured ~8x
        # slower on this machine's first run).
        engine.kv_cache.zero_()
    return engine


def build_dp_engine(spec: WorkerSpec, address: str, port: int):
    """A data-parallel rank's engine (``DpEngine``): join the group at its rank 0's
    ``address:port``, load this rank's share of the experts and the rest whole."""
    import torch

    from workers.parallel.dp_group import DpEngine, join_dp_group

    if spec.num_threads > 0:
        torch.set_num_threads(spec.num_threads)
    device_type = "cuda" if spec.engine.device.startswith("cuda") else "cpu"
    parallel, lockstep = join_dp_group(spec.dp_rank, spec.data_parallel, address, port, device_type)
    dp = DpEngine(spec.engine_settings(), parallel, lockstep)
    if dp.engine.device.type == "cpu":
        dp.engine.kv_cache.zero_()  # as build_engine: the pages touched before the first KV
    return dp


def connector_factory(spec: WorkerSpec, rank: int) -> Callable:
    """``(engine, on_release) -> KVConnector`` for one rank: its heads of its stage's
    layers, its own agent."""
    from kvtransfer import KVLayout, create_connector

    transfer = spec.kv_transfer

    def make(engine: LLMEngine, on_release):
        parallel = engine.parallel
        layout = KVLayout.from_tensor(
            engine.kv_cache,
            model_id=spec.model_id,
            num_kv_heads=engine.arch.kv_cache_heads,  # MLA: 1, the latent row
            tp_rank=parallel.tp_rank,
            tp_size=parallel.tp_size,
            first_layer=engine.layer_range[0],
            total_num_layers=engine.arch.num_hidden_layers,
        )
        return create_connector(transfer, layout, engine.kv_cache, spec.rank_name(rank), on_release)

    return make
