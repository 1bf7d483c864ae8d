"""Data-parallel attention for MoE models: a group of engines in lockstep sharing experts.

Each rank of a data-parallel (DP) group is a whole engine (``LLMEngine``): its own
requests, scheduler, block manager and KV / latent cache, attention and dense layers run
locally (``tp_size`` 1, nothing split). Only the MoE layers are shared: their experts are
split over the group (``expert_parallel`` = the group's size, ``ExpertPlacement``) and each
layer's tokens reach their experts through a data-parallel dispatcher
(``workers/models/expert_parallel.py``: every rank brings its own, uneven, token count).
As in vLLM's and SGLang's DP attention, a request's KV lives on one rank only: nothing is
cached twice, so where a TP replica replicates (MLA's latent row on every rank, KV heads
fewer than ranks) the group holds up to ``dp_size`` times its requests at the same memory
(bench/dp_attention.py), and attention needs no collective.

**Lockstep.** The dispatchers' collectives pair up only if every rank runs one forward per
step, so each step every rank runs, in order:

1. its engine's ``step`` (schedule, forward, sample, update); just before the forward
   (the runner's ``before_forward``) one small all-gather (``DpLockstep.sync``) tells
   every rank every rank's token count and unfinished requests;
2. a rank whose step ran no forward (no request, or none ready: all RECEIVING) takes part
   in that same all-gather after its step, with zero tokens, and, if any rank has tokens,
   runs an *empty forward*: each MoE layer's dispatcher with no rows of its own, in layer
   order, so the other ranks' tokens still reach this rank's experts;
3. when every rank reports no tokens and no unfinished request, the group is idle
   (``is_idle``) and nobody forwards; a serving loop waits for work and steps again.

**Stopping.** A rank asked to stop (``stopping``) says so in its next step's all-gather,
and every rank sees ``is_group_stopping`` after that same step: the group's loops end
together, none left waiting in a collective for a peer that has gone.

**A dead rank.** Every collective of the group carries ``MODEL_GROUP_TIMEOUT_S``: a rank
that dies closes its connections and the others' next collective fails at once, a hung one
fails it at the deadline. The step raises on every surviving rank, their requests end
retryably (migration: router/migration.py) and the group is restarted together.

Refused: by ``check_data_parallel``, speculative decoding, the expert rebalancer and an
``expert_parallel`` other than the group's size; by ``ParallelContext``, TP or pipeline
stages inside a rank; by the loader, a dense model (``expert_parallel``: no experts; nothing
to share: run independent replicas). docs/moe.md, "Data-parallel attention".
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from workers.engine.config import EngineConfig
from workers.engine.llm_engine import LLMEngine
from workers.engine.outputs import StreamDelta
from workers.engine.step_inputs import StepInputs
from workers.models.expert_parallel import DpStepTokens
from workers.models.parallel import ParallelContext
from workers.parallel.replica import GROUP_TIMEOUT_S, MODEL_GROUP_TIMEOUT_S


def check_data_parallel(config: EngineConfig, dp_size: int) -> None:
    """Refuse what a data-parallel group cannot run, naming the setting (ValueError)."""
    if dp_size < 2:
        raise ValueError(f"attention: data_parallel needs at least 2 ranks, got {dp_size}")
    if config.expert_parallel != dp_size:
        raise ValueError(
            f"attention: data_parallel: expert_parallel must equal the group's {dp_size} "
            f"ranks (the experts are split over them), got {config.expert_parallel}"
        )
    if config.speculative_method is not None:
        raise ValueError(
            "attention: data_parallel: speculative decoding is not supported (a verify step "
            "runs more forwards than its peers' lockstep allows); unset speculative_method"
        )
    if config.expert_rebalance_steps:
        raise ValueError(
            "attention: data_parallel: the expert rebalancer is not built for data-parallel "
            "ranks (its plan is taken from one TP group's rank 0); set expert_rebalance_steps 0"
        )


def join_dp_group(
    dp_rank: int, dp_size: int, address: str, port: int, device_type: str
) -> tuple[ParallelContext, dist.ProcessGroup]:
    """Join the group (rank 0 hosts the store at ``address:port``). Returns the layers'
    ``ParallelContext`` (its ``dp_group`` carries the MoE dispatch: NCCL on CUDA, gloo on
    CPU) and the lockstep's gloo group (host memory: a few ints a step)."""
    backend = "nccl" if device_type == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        init_method=f"tcp://{address}:{port}",
        rank=dp_rank,
        world_size=dp_size,
        timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S),
    )
    # Their own deadline, tight: once loaded, every step resynchronises the ranks, so a
    # longer wait is a stuck peer (workers/parallel/replica.py).
    timeout = datetime.timedelta(seconds=MODEL_GROUP_TIMEOUT_S)
    experts = dist.new_group(list(range(dp_size)), timeout=timeout)
    lockstep = dist.new_group(list(range(dp_size)), backend="gloo", timeout=timeout)
    parallel = ParallelContext(
        dp_rank=dp_rank, dp_size=dp_size, dp_group=experts, dp_tokens=DpStepTokens(dp_size)
    )
    return parallel, lockstep


class DpLockstep:
    """The group's per-step agreement: every rank's token count, unfinished requests and
    whether it is stopping."""

    def __init__(self, tokens: DpStepTokens, group: dist.ProcessGroup | None) -> None:
        self.tokens = tokens  # the layers' view of the step (ParallelContext.dp_tokens)
        self.group = group
        self.num_unfinished: tuple[int, ...] = (0,) * len(tokens.num_tokens)
        self.is_group_stopping = False

    def sync(self, num_tokens: int, num_unfinished: int, is_stopping: bool = False) -> None:
        """One all-gather of (tokens this forward, unfinished requests, stopping) with every
        rank; every rank calls it once a step, in the same order as its peers."""
        dp_size = len(self.tokens.num_tokens)
        mine = torch.tensor([num_tokens, num_unfinished, int(is_stopping)], dtype=torch.int64)
        every = torch.empty(dp_size * 3, dtype=torch.int64)
        dist.all_gather_single(every, mine, group=self.group)
        rows = every.view(dp_size, 3).tolist()
        self.tokens.num_tokens = tuple(row[0] for row in rows)
        self.num_unfinished = tuple(row[1] for row in rows)
        self.is_group_stopping = any(row[2] for row in rows)

    @property
    def has_tokens(self) -> bool:
        return self.tokens.max_tokens > 0

    @property
    def is_idle(self) -> bool:
        """No rank had tokens this step, and none has an unfinished request."""
        return not self.has_tokens and not any(self.num_unfinished)


class DpEngine:
    """One rank of a data-parallel group: an ``LLMEngine`` whose ``step`` keeps lockstep.

    Requests are added to, aborted on and handed off into ``engine`` as on any engine (the
    rank that owns a request is the only one that knows it). Every rank must call ``step``
    the same number of times: a driver loops ``step`` on all ranks until ``is_idle``
    (offline), or forever, waiting a little between idle steps (a serving worker)."""

    def __init__(
        self,
        config: EngineConfig,
        parallel: ParallelContext,
        lockstep_group: dist.ProcessGroup | None,
        **engine_args: object,
    ) -> None:
        check_data_parallel(config, parallel.dp_size)
        if engine_args.get("batches_in_flight") not in (None, 1):
            raise ValueError("attention: data_parallel: one batch in flight (one forward a step)")
        if parallel.dp_tokens is None:
            parallel = dataclasses.replace(parallel, dp_tokens=DpStepTokens(parallel.dp_size))
        assert parallel.dp_tokens is not None
        self.lockstep = DpLockstep(parallel.dp_tokens, lockstep_group)
        self._synced = False
        self.engine = LLMEngine(
            config,
            parallel=parallel,
            before_forward=self._before_forward,
            agree_num_blocks=None,  # each rank its own cache: nothing to agree
            **engine_args,  # type: ignore[arg-type]
        )
        self._empty_forward = empty_forward(
            self.engine.model, self.engine.dtype, self.engine.device
        )
        self.num_steps = 0
        self.num_empty_forwards = 0
        self.stopping = False  # set to stop the group after the next step (any rank may)

    @property
    def is_idle(self) -> bool:
        """The group's last step: no rank had tokens or an unfinished request."""
        return self.lockstep.is_idle

    @property
    def is_group_stopping(self) -> bool:
        """A rank of the group said ``stopping`` in the last step: every rank stops now."""
        return self.lockstep.is_group_stopping

    def step(self) -> list[StreamDelta]:
        """One lockstep step (module docstring); this rank's deltas."""
        self._synced = False
        deltas = self.engine.step()
        if not self._synced:  # no forward of our own: take part in the step anyway
            self.lockstep.sync(0, self._num_unfinished(), self.stopping)
            if self.lockstep.has_tokens:
                self._empty_forward()
                self.num_empty_forwards += 1
        self.num_steps += 1
        return deltas

    def _before_forward(self, inputs: StepInputs) -> None:
        self.lockstep.sync(inputs.num_tokens, self._num_unfinished(), self.stopping)
        self._synced = True

    def _num_unfinished(self) -> int:
        return int(self.engine.has_unfinished_requests())


def empty_forward(model: nn.Module, dtype: torch.dtype, device: torch.device) -> Callable[[], None]:
    """The collectives of a forward with no tokens of this rank: each MoE layer's
    dispatcher, in layer order, with empty rows (the other ranks' pairs still reach this
    rank's experts and come back). Attention and dense layers have no collective here."""
    blocks = sorted(
        (m for m in model.modules() if getattr(m, "dispatch", None) is not None),
        key=lambda block: block.layer_idx,
    )

    @torch.inference_mode()
    def run() -> None:
        for block in blocks:
            hidden = torch.empty(0, block.experts.hidden_size, dtype=dtype, device=device)
            weights = torch.empty(0, block.top_k, dtype=torch.float32, device=device)
            ids = torch.empty(0, block.top_k, dtype=torch.int64, device=device)
            block.dispatch(hidden, weights, ids, block._local_experts)

    return run
