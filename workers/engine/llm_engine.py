"""The engine loop every worker runs: schedule -> execute -> sample -> update.

Single-threaded and synchronous: callers add and abort requests between steps and read
each step's ``StreamDelta``s. Prefill and decode workers run this same loop; their
requests differ only at the ends (see ``add_request``):

- prefill role (``prefill_only``): after the first token the request leaves the
  scheduler, its blocks *held* with the prompt's KV by the hand-off (``self.handoff``);
  the worker drives the offer and the lease there (or calls ``release_held`` once the
  decode side has pulled them).
- decode role (``remote_first_token``): the request is admitted into RECEIVING with
  fresh blocks for its prompt; the worker takes them from ``take_kv_receives``,
  transfers the KV into them and calls ``kv_received``; then it decodes.

Who frees which block of a hand-off, and when: ``workers/engine/handoff.py``.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Callable, Sequence
from functools import partial

import torch

from workers.engine.batches import BatchesInFlight
from workers.engine.block_manager import BlockManager
from workers.engine.cache_sizing import resolve_max_model_len, resolve_num_blocks
from workers.engine.config import EngineConfig, check_expert_parallel
from workers.engine.cpu_memory import keep_freed_memory_mapped
from workers.engine.decode_graphs import build_decode_graphs
from workers.engine.grammar import GrammarCompiler
from workers.engine.handoff import KVHandoff, KVReceive
from workers.engine.kv_cache import allocate_kv_cache
from workers.engine.kv_tiers.build import build_kv_tiers, check_single_rank_tiers
from workers.engine.layerwise import LayerwiseStreams
from workers.engine.model_runner import ModelRunner
from workers.engine.outputs import StreamDelta
from workers.engine.prompt_logprobs import prompt_logprobs
from workers.engine.request import Request
from workers.engine.request_intake import build_request
from workers.engine.resume import resume_outputs
from workers.engine.sampler import Sampler, SamplerOutput, SamplingRow
from workers.engine.scheduler import ScheduledChunk, Scheduler, SchedulerOutput
from workers.engine.speculative.decoder import SpeculativeDecoder, check_single_rank
from workers.engine.speculative.draft import DraftProposer
from workers.engine.speculative.rejection import Verified
from workers.engine.speculative.stats import SpecDecodeStats
from workers.engine.step_inputs import StepInputs
from workers.engine.step_outputs import StepOutputs
from workers.engine.step_times import StepTimes
from workers.models.expert_rebalance import ExpertRebalancer, moe_blocks
from workers.models.gguf import derive_model_dir, is_gguf_file
from workers.models.gguf.derive import default_cache_dir
from workers.models.hub import is_hub_path, resolve_hub_path
from workers.models.loader import load_model
from workers.models.parallel import ParallelContext
from workers.protocol.logprobs import TokenLogprobs
from workers.protocol.sampling_params import SamplingParams
from workers.text.detokenizer import IncrementalDetokenizer
from workers.text.tokenizer import Tokenizer


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        tokenizer: Tokenizer | None = None,
        parallel: ParallelContext | None = None,
        *,
        before_forward: Callable[[StepInputs], None] | None = None,
        agree_num_blocks: Callable[[int], int] | None = None,
        batches_in_flight: int | None = None,
    ):
        """``parallel``: one rank of a replica (a TP rank of a pipeline stage, caching its
        layers' KV only). Rank 0 (the last stage: it samples) sends each step's inputs
        with ``before_forward`` to the others, which run ``runner.run``
        (``workers/replica_*.py``); ``agree_num_blocks`` agrees the KV-cache size.
        ``batches_in_flight``: at most this many batches in the pipeline at once
        (default: one per pipeline stage; 1 runs the stages one batch at a time)."""
        if is_hub_path(config.model):  # hf://org/name: downloaded once
            hub_dir = resolve_hub_path(config.model, default_cache_dir())
            config = dataclasses.replace(config, model=str(hub_dir))
        if is_gguf_file(config.model):  # served through its derived Hugging Face view
            config = dataclasses.replace(config, model=str(derive_model_dir(config.model)))
        self.config = config
        parallel = parallel or ParallelContext()
        check_expert_parallel(config, parallel.ep_size)
        self.parallel = dataclasses.replace(
            parallel,
            deterministic=config.deterministic,
            expert_parallel=config.expert_parallel > 1,
            expert_dispatch=config.expert_dispatch,
            expert_redundant=config.expert_redundant if config.expert_rebalance_steps else 0,
        )
        check_single_rank(config, self.parallel.tp_size, self.parallel.pp_size, batches_in_flight)
        check_single_rank_tiers(config, self.parallel)
        self.device = config.resolve_device()
        self.dtype = config.resolve_dtype(self.device)
        if self.device.type == "cpu":
            keep_freed_memory_mapped()
        self.model, self.arch = load_model(
            config.model,
            dtype=self.dtype,
            device=self.device,
            parallel=self.parallel,
            quantization=config.quantization,
            deterministic=config.deterministic,
        )
        self.tokenizer = tokenizer if tokenizer is not None else Tokenizer.from_dir(config.model)
        self.max_model_len = resolve_max_model_len(config, self.arch)
        self.vocab_size = self.arch.vocab_size
        self.num_kv_heads, _ = self.parallel.kv_heads(self.arch.kv_cache_heads)
        self.layer_range = self.parallel.layer_range(self.arch.num_hidden_layers)
        num_layers = self.layer_range[1] - self.layer_range[0]
        draft = None
        if config.speculative_method == "draft":
            assert config.speculative_draft_model is not None  # EngineConfig checks it
            draft = DraftProposer(
                config.speculative_draft_model, self.dtype, self.device, self.vocab_size,
                self.max_model_len,
            )  # fmt: skip
        num_blocks = resolve_num_blocks(
            config, self.arch, self.dtype, self.device, self.max_model_len, self.num_kv_heads,
            num_layers, draft.bytes_per_block(config.block_size) if draft else 0,
        )  # fmt: skip
        if agree_num_blocks is not None:
            num_blocks = agree_num_blocks(num_blocks)
        self.kv_cache = allocate_kv_cache(
            num_blocks,
            num_layers,
            self.num_kv_heads,
            config.block_size,
            self.arch.kv_cache_head_dim,
            self.dtype,
            self.device,
            config.kv_cache_dtype,
            self.arch.kv_cache_entries,
        )
        self.block_manager = BlockManager(
            num_blocks, config.block_size, config.enable_prefix_caching
        )
        # The KV tiers below the pool (docs/kv-tiers.md); None when none is configured.
        # Other parts read ``kv_tiers.tiers`` (stats, events) and ``kv_tiers.lookup``.
        self.kv_tiers = build_kv_tiers(config, self.kv_cache, self.block_manager)
        # Each request's KV hand-off (prefill: held blocks; decode: receives); the worker
        # (workers/serving/service.py) drives its transport side.
        self.handoff = KVHandoff(self.block_manager)
        # One slot per pipeline stage: that many batches in flight keep every stage busy.
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            num_slots=self.parallel.pp_size if batches_in_flight is None else batches_in_flight,
            handoff=self.handoff,
            tiers=self.kv_tiers,
        )
        self._in_flight = BatchesInFlight()
        self.runner = ModelRunner(
            self.model, self.kv_cache, config.block_size, self.device, before_forward
        )
        if config.expert_rebalance_steps:  # every rank: rank 0 decides, all swap alike
            self.runner.rebalancer = ExpertRebalancer(
                moe_blocks(self.model),
                config.expert_rebalance_steps,
                self.parallel.tp_rank,
                self.parallel.group,
            )
        if self.parallel.ep_size == 1 and self.parallel.pp_size == 1:  # captured at start-up
            self.runner.graphs = build_decode_graphs(
                self.model, self.kv_cache, config.block_size, self.max_model_len,
                config.max_num_seqs, config.cuda_graph_max_batch, self.device,
            )  # fmt: skip
        self.sampler = Sampler(self.vocab_size, seed=config.seed)
        # Prefill: requests whose KV streams out layer group by layer group (layerwise.py).
        first_layer = getattr(self.model.model, "start_layer", 0)  # a pipeline stage's
        self.layerwise = LayerwiseStreams(
            config.block_size, first_layer, self.kv_cache.shape[1], self.handoff
        )
        # Structured outputs: compiled grammars by constraint (built on first use).
        self.grammars = GrammarCompiler(self.tokenizer, self.vocab_size)
        # The speculation gate's clock: on CPU this process's CPU time (steady when other
        # processes share the cores; the work is all here), on an accelerator wall time.
        self._spec_clock = time.process_time if self.device.type == "cpu" else time.perf_counter
        self.spec: SpeculativeDecoder | None = None
        if config.speculative_method is not None:
            if draft is not None:
                draft.bind(num_blocks, config.block_size)
                draft.clock = self._spec_clock
            self.spec = SpeculativeDecoder(config, self.sampler, draft)
        # Empty when config.detokenize is False (the router detokenizes at the edge).
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._outputs = StepOutputs(
            self.scheduler, self.handoff, self._detokenizers, self.max_model_len
        )
        self._pending: list[StreamDelta] = []  # finals of aborted requests, sent next step
        self.step_times = StepTimes()
        self._last_sched: SchedulerOutput | None = None  # the batch the last step completed

    @property
    def spec_stats(self) -> SpecDecodeStats:
        """Speculative decoding's counters since start (all zero while it is off)."""
        return self.spec.stats if self.spec is not None else SpecDecodeStats()

    # ---- requests --------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        *,
        prefill_only: bool = False,
        remote_first_token: int | None = None,
        prior_output_token_ids: Sequence[int] = (),
        peer_prefix_tokens: int = 0,
        await_first_token: bool = False,
    ) -> str:
        """Validate and queue a request; returns its id. Raises ValueError naming the problem.

        ``prefill_only`` (prefill worker): compute the prompt and sample the first token.
        Unless that token ends the request (then it finishes as usual), its final delta has
        ``finish_reason=None`` and ``held_block_ids``: blocks kept with the prompt's KV
        until ``release_held``. The text released with the first token is in that delta;
        text withheld (a possible stop-string start, an incomplete character) is not
        flushed: the decode side emits it.

        ``remote_first_token`` (decode worker): the first output token, sampled by the
        prefill worker; the prompt's KV arrives via ``take_kv_receives``/``kv_received``.
        The token is not emitted again; the seeded stream continues after it. Raises
        ValueError if that token already ends the request (the prefill worker finishes
        such requests itself).

        ``prior_output_token_ids`` (a request migrated from a worker that died): its output
        so far; the request continues after it exactly as it would have there (seeded
        sampling included), its KV recomputed here (``workers/engine/resume.py``).

        ``params.prompt_logprobs``: the prompt is computed whole here (no prefix-cache,
        KV-tier or peer hit) and the first delta with tokens carries its logprobs; not on a
        decode worker (``remote_first_token``: its prefill worker sent them).

        ``params.structured``: compiled here (cached by constraint; ValueError naming what
        fails); the request's matcher is fed the tokens above, so a decode worker or a
        migrated request continues in the grammar where the other worker stood.

        ``await_first_token`` (decode worker, layer-wise hand-off): as ``remote_first_token``
        but the token comes later (``set_remote_first_token``), while the prefill streams
        the KV into the blocks this request is admitted with; the worker reports
        ``kv_received`` only once both are in (workers/serving/stream_transport.py).

        ``peer_prefix_tokens`` (peer pull, G4): the KV of the prompt's first tokens (whole
        blocks) comes from another worker's lease, like a remote prefill's, through
        ``take_kv_receives``/``kv_received``; the rest is computed here after it arrived.
        """
        request_id = request_id or uuid.uuid4().hex
        if (state := self.handoff.state(request_id)) is not None:
            raise ValueError(f"request_id {request_id!r} is already in use ({state.value})")
        req, detok = build_request(
            prompt,
            params,
            request_id,
            tokenizer=self.tokenizer,
            vocab_size=self.vocab_size,
            max_model_len=self.max_model_len,
            block_size=self.block_manager.block_size,
            device=self.device,
            grammars=self.grammars,
            detokenize=self.config.detokenize,
            prefill_only=prefill_only,
            remote_first_token=remote_first_token,
            prior_output_token_ids=prior_output_token_ids,
            peer_prefix_tokens=peer_prefix_tokens,
            await_first_token=await_first_token,
        )
        self.scheduler.add(req)
        if detok is not None:
            self._detokenizers[request_id] = detok
        return request_id

    def abort_request(self, request_ids: str | Sequence[str]) -> None:
        """Abort at any moment between steps; the final delta comes with the next ``step``.

        A held id (prefill role) is left to the hand-off, with no delta (its stream already
        ended): freed now if no lease was offered yet, else at the lease's end. A RECEIVING
        request (decode role) keeps its blocks until ``kv_received``, since the transfer
        may still be writing into them; its final delta comes after that.
        """
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for request_id in ids:
            if request_id not in self.scheduler.requests:
                self.handoff.abort(request_id)  # held, or no such request
        for req in self.scheduler.abort(ids):
            self._pending.append(self._final_delta(req, (), "", None))

    def has_unfinished_requests(self) -> bool:
        """True while anything is waiting, running or RECEIVING, or a final is unsent.
        Held requests do not count: they need no more steps."""
        return self.scheduler.num_unfinished > 0 or bool(self._pending or self._in_flight)

    # ---- KV hand-off -----------------------------------------------------------------
    def release_held(self, request_id: str) -> bool:
        """Prefill role: free a held request's blocks, once the decode side has pulled its
        KV or will not (an in-process hand-off; a worker ends the lease instead:
        ``KVHandoff.lease_ended``). False for an unknown or released id."""
        return self.handoff.release(request_id)

    @property
    def num_held(self) -> int:
        return self.handoff.num_held

    def is_held(self, request_id: str) -> bool:
        """Prefill role: the request's KV blocks are held for a decode worker."""
        return self.handoff.is_held(request_id)

    def take_kv_receives(self) -> list[KVReceive]:
        """Decode role: the requests admitted into RECEIVING since the last call (by
        ``step``; also in a step that computed nothing). The worker transfers each
        prompt's blocks from ``first_block`` on (the ones before are this worker's own
        prefix-cache hits) into exactly ``block_ids``, in order, and then calls
        ``kv_received`` for it."""
        return self.handoff.take_receives()

    def kv_received(self, request_id: str, ok: bool) -> None:
        """Decode role: the transfer into a RECEIVING request's blocks has ended.

        ``ok``: the next step decodes from the received KV; else the prompt is recomputed
        here. One aborted while receiving is finished now (blocks freed); its final delta
        comes with the next ``step``. ValueError for a request not RECEIVING."""
        req = self.scheduler.finish_receiving(request_id, ok)
        if req.is_finished:
            self._pending.append(self._final_delta(req, (), "", None))

    def set_remote_first_token(self, request_id: str, token_id: int) -> None:
        """Decode role, layer-wise: the first token of a request added with
        ``await_first_token`` (before ``kv_received``); ValueError as ``add_request``."""
        req = self.scheduler.requests.get(request_id)
        if req is None or not req.is_remote_prefill or req.num_output_tokens:
            raise ValueError(f"{request_id!r} does not wait for its first token")
        detok = self._detokenizers.get(request_id)
        resume_outputs(req, [token_id], detok, self.vocab_size, self.max_model_len, "first_token")

    @property
    def num_receiving(self) -> int:
        return self.handoff.num_receiving

    # ---- the step --------------------------------------------------------------------
    @property
    def num_in_flight(self) -> int:
        """Batches sent down the pipeline and not yet sampled (0 without stages)."""
        return len(self._in_flight)

    def step(self) -> list[StreamDelta]:
        """One engine step: fill the free slots with batches, then sample the oldest.

        Without pipeline stages that is one batch, scheduled and sampled here. If the
        model or sampler raises, no request of a batch in flight advances (their blocks
        stay allocated for a retry) and the finals of aborted requests are kept."""
        start = self._spec_clock()
        spec_prepare = None
        if self.spec is not None and not self._in_flight:
            self.spec.propose(self.scheduler, self.max_model_len)
            spec_prepare = partial(self.spec.before_prepare, requests=self.scheduler.requests)

        def before_prepare(sched: SchedulerOutput) -> None:
            if spec_prepare is not None:
                spec_prepare(sched)
            # The other ranks of a replica run this step's layer-wise writes too (ReplicaKV).
            self.layerwise.launching(sched, self.scheduler.requests)

        self._in_flight.launch(self.scheduler, self.runner, before_prepare)
        if not self._in_flight:
            deltas, self._pending = self._pending, []
            return deltas
        deltas = self._complete()
        if self.spec is not None:
            assert self._last_sched is not None
            self.spec.observe(self._last_sched, self._spec_clock() - start)
        deltas, self._pending = self._pending + deltas, []
        return deltas

    def drain(self) -> None:
        """Sample every batch in flight; their deltas come with the next ``step``.
        (Rank 0 does this before it waits for the other ranks: ``ReplicaKV``.)"""
        while self._in_flight:
            self._pending.extend(self._complete())

    def _complete(self) -> list[StreamDelta]:
        """Run rank 0's part of the oldest batch in flight (all of it without stages),
        sample, update. If the model or sampler raises, no request of any batch in flight
        advances (their blocks stay allocated for a retry)."""
        batch = self._in_flight.popleft()
        self._last_sched = batch.sched
        t0 = time.perf_counter()
        # A chunk whose prefix a tier onboards layer-wise waits per layer (kv_tiers/).
        onboard = self.kv_tiers.layerwise if self.kv_tiers is not None else None
        onboard = onboard if onboard is not None and onboard.jobs else None
        try:
            hook = self.layerwise.hook_for(batch.sched, batch.requests)
            if onboard is not None:
                hook = onboard.hook_for(batch.requests, hook)
            if hook is None:
                logits = self.runner.run(batch.inputs)
            else:  # a chunk streams its KV layer group by layer group (layerwise.py)
                logits = self.runner.run(batch.inputs, hook)
            if logits is None:
                raise RuntimeError("the rank that schedules must run the last pipeline stage")
            t1 = time.perf_counter()
            num_sampled = len(batch.inputs.sample_indices)
            prompt_rows = logits[num_sampled:] if batch.inputs.prompt_logprob_indices else None
            if prompt_rows is not None:
                logits = logits[:num_sampled]
            live, logits = batch.live(self.scheduler.requests, logits)
            if onboard is not None:  # a chunk whose prefix failed to arrive is dropped
                live, logits = onboard.settle(batch.requests, live, logits, self.scheduler)
            sampled, verified = self._sample(live, logits)
            prompt: dict[str, list[TokenLogprobs]] = {}
            if prompt_rows is not None:
                requests = self.scheduler.requests
                chunks = [
                    (c, r if requests.get(c.request_id) is r else None)
                    for c, r in zip(batch.sched.chunks, batch.requests, strict=True)
                ]
                prompt = prompt_logprobs(prompt_rows, chunks, self.vocab_size)
        except BaseException:
            if onboard is not None:
                onboard.cancel_all(batch.requests, self.scheduler)
            self._in_flight.cancel(batch, self.scheduler)
            if self.spec is not None:
                self.spec.cancelled(batch.requests)
            raise
        t2 = time.perf_counter()
        deltas = self._outputs.update(live, sampled, verified, self.spec, prompt)
        stages = (batch.schedule_s, batch.prepare_s, batch.prepare_s + t1 - t0, t2 - t1)
        stages += (time.perf_counter() - t2,)
        self.step_times.add(len(batch.sched.chunks), batch.sched.num_batched_tokens, stages)
        return deltas

    def _sample(
        self, live: list[tuple[ScheduledChunk, Request]], logits: torch.Tensor
    ) -> tuple[SamplerOutput, list[Verified]]:
        if self.spec is not None:
            return self.spec.sample(live, logits)
        plain = [SamplingRow.of(r) for c, r in live if c.needs_sample]
        return self.sampler(logits, plain), []

    def _final_delta(
        self,
        req: Request,
        token_ids: tuple[int, ...],
        text: str,
        logprobs: tuple[TokenLogprobs, ...] | None,
    ) -> StreamDelta:
        return self._outputs.final_delta(req, token_ids, text, logprobs)
