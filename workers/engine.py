"""The engine loop every worker runs: schedule -> execute -> sample -> update.

Single-threaded and synchronous: callers add and abort requests between steps
and read each step's ``StreamDelta``s (the streaming interface the prefill and
decode workers build on).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Sequence

import torch

from workers.block_manager import BlockManager
from workers.config import EngineConfig
from workers.cpu_memory import keep_freed_memory_mapped
from workers.detokenizer import IncrementalDetokenizer
from workers.kv_cache import allocate_kv_cache, bytes_per_block
from workers.model_runner import ModelRunner
from workers.models.arch_config import ArchConfig
from workers.models.loader import load_model
from workers.outputs import StreamDelta
from workers.request import FinishReason, Request
from workers.sampler import Sampler, SamplerOutput, SamplingRow, TokenLogprobs, make_generator
from workers.sampling_params import SamplingParams
from workers.scheduler import Scheduler, SchedulerOutput
from workers.step_times import StepTimes
from workers.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig, tokenizer: Tokenizer | None = None):
        self.config = config
        self.device = config.resolve_device()
        self.dtype = config.resolve_dtype(self.device)
        if self.device.type == "cpu":
            keep_freed_memory_mapped()
        self.model, self.arch = load_model(config.model, dtype=self.dtype, device=self.device)
        self.tokenizer = tokenizer if tokenizer is not None else Tokenizer.from_dir(config.model)
        self.max_model_len = _resolve_max_model_len(config, self.arch)
        self.vocab_size = self.arch.vocab_size
        num_blocks = self._resolve_num_blocks()
        self.kv_cache = allocate_kv_cache(
            num_blocks,
            self.arch.num_hidden_layers,
            self.arch.num_key_value_heads,
            config.block_size,
            self.arch.head_dim,
            self.dtype,
            self.device,
        )
        self.block_manager = BlockManager(
            num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            self.block_manager, config.max_num_seqs, config.max_num_batched_tokens
        )
        self.runner = ModelRunner(self.model, self.kv_cache, config.block_size, self.device)
        self.sampler = Sampler(self.vocab_size, seed=config.seed)
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._pending: list[StreamDelta] = []  # finals of aborted requests, sent next step
        self.step_times = StepTimes()

    # ---- requests --------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
    ) -> str:
        """Validate and queue a request; returns its id. Raises ValueError naming the problem."""
        request_id = request_id or uuid.uuid4().hex
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        params.validate_for_model(self.vocab_size)
        token_ids = self._prompt_token_ids(prompt)
        room = self.max_model_len - len(token_ids)
        if room < 1:
            raise ValueError(
                f"prompt: {len(token_ids)} tokens leave no room to generate within "
                f"max_model_len={self.max_model_len}"
            )
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        req = Request(
            request_id=request_id,
            prompt_token_ids=token_ids,
            params=params,
            max_tokens=max_tokens,
            eos_token_ids=frozenset() if params.ignore_eos else self.tokenizer.eos_token_ids,
            generator=make_generator(params, self.device),
        )
        self.scheduler.add(req)
        self._detokenizers[request_id] = IncrementalDetokenizer(
            self.tokenizer, token_ids, params.stop, params.skip_special_tokens
        )
        return request_id

    def abort_request(self, request_ids: str | Sequence[str]) -> None:
        """Abort at any moment between steps; the final delta comes with the next ``step``."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for req in self.scheduler.abort(ids):
            self._pending.append(self._final_delta(req, (), "", None))

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0 or bool(self._pending)

    # ---- the step --------------------------------------------------------------------
    def step(self) -> list[StreamDelta]:
        """One engine step. If the model or sampler raises, no request advances (their
        blocks stay allocated for a retry) and the finals of aborted requests are kept."""
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        if sched.is_empty:
            deltas, self._pending = self._pending, []
            return deltas
        t1 = time.perf_counter()
        logits = self.runner.execute(sched, self.scheduler.requests)
        t2 = time.perf_counter()
        sampled = self.sampler(logits, self._sampling_rows(sched))
        t3 = time.perf_counter()
        deltas, self._pending = self._pending, []
        deltas.extend(self._update(sched, sampled))
        t4 = time.perf_counter()
        self.step_times.add(
            len(sched.chunks),
            sched.num_batched_tokens,
            (t1 - t0, self.runner.last_prepare_s, t2 - t1, t3 - t2, t4 - t3),
        )
        return deltas

    def _sampling_rows(self, sched: SchedulerOutput) -> list[SamplingRow]:
        rows = []
        for chunk in sched.chunks:
            if not chunk.needs_sample:
                continue
            req = self.scheduler.requests[chunk.request_id]
            rows.append(
                SamplingRow(
                    params=req.params,
                    prompt_token_ids=req.prompt_token_ids,
                    output_token_ids=req.output_token_ids,
                    generator=req.generator,
                    eos_token_ids=req.eos_token_ids,  # empty under ignore_eos
                )
            )
        return rows

    def _update(self, sched: SchedulerOutput, sampled: SamplerOutput) -> list[StreamDelta]:
        deltas = []
        row = 0
        for chunk in sched.chunks:
            req = self.scheduler.update_computed(chunk)
            if not chunk.needs_sample:
                continue
            token_id = sampled.token_ids[row]
            logprobs = sampled.logprobs[row]
            row += 1
            req.append_token(token_id)
            deltas.append(self._after_token(req, token_id, logprobs))
        return deltas

    def _after_token(
        self, req: Request, token_id: int, logprobs: TokenLogprobs | None
    ) -> StreamDelta:
        """Detokenize and apply the stop conditions to a request's new token."""
        params = req.params
        # Stop conditions (EOS, stop ids, stop strings) apply once min_tokens are out.
        may_stop = req.num_output_tokens >= params.min_tokens
        detok = self._detokenizers[req.request_id].step([token_id], check_stop=may_stop)
        text = detok.text
        reason: FinishReason | None = None
        stop_reason: str | int | None = None
        if may_stop:
            if token_id in req.eos_token_ids:
                reason = FinishReason.STOP
            elif token_id in params.stop_token_ids:
                reason, stop_reason = FinishReason.STOP, token_id
            elif detok.stop_matched is not None:
                reason, stop_reason = FinishReason.STOP, detok.stop_matched
        if reason is None and (
            req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.max_model_len
        ):
            reason = FinishReason.LENGTH
        new_logprobs = (logprobs,) if logprobs is not None else None
        if reason is None:
            return StreamDelta(
                req.request_id,
                (token_id,),
                text,
                new_logprobs,
                finished=False,
                num_prompt_tokens=req.num_prompt_tokens,
                num_cached_tokens=req.num_cached_tokens,
            )
        req.stop_reason = stop_reason
        self.scheduler.finish(req, reason)
        return self._final_delta(req, (token_id,), text, new_logprobs)

    def _final_delta(
        self,
        req: Request,
        token_ids: tuple[int, ...],
        text: str,
        logprobs: tuple[TokenLogprobs, ...] | None,
    ) -> StreamDelta:
        detok = self._detokenizers.pop(req.request_id)
        if req.stop_reason is None or isinstance(req.stop_reason, int):
            text += detok.flush()  # held back for a stop string that never came
        return StreamDelta(
            req.request_id,
            token_ids,
            text,
            logprobs,
            finished=True,
            finish_reason=req.finish_reason,
            stop_reason=req.stop_reason,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=req.num_cached_tokens,
        )

    # ---- helpers ---------------------------------------------------------------------
    def _prompt_token_ids(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            token_ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, Sequence) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            token_ids = list(prompt)
        else:
            raise ValueError("prompt must be a string or a list of int token ids")
        if not token_ids:
            raise ValueError("prompt is empty")
        # Also for text: a tokenizer with ids past the model's embedding would otherwise
        # fail inside a step, for every request in the batch.
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"prompt token ids out of vocabulary [0, {self.vocab_size}): {bad[:5]}"
            )
        return token_ids

    def _resolve_num_blocks(self) -> int:
        config = self.config
        per_block = bytes_per_block(
            self.arch.num_hidden_layers,
            self.arch.num_key_value_heads,
            config.block_size,
            self.arch.head_dim,
            self.dtype,
        )
        if config.num_kv_blocks is not None:
            num_blocks = config.num_kv_blocks
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free
            budget = total * config.gpu_memory_fraction - used
            num_blocks = int(budget // per_block)
        else:
            num_blocks = int(config.kv_cache_memory_gib * 2**30 // per_block)
        min_blocks = -(-self.max_model_len // config.block_size)
        if config.num_kv_blocks is None:
            # More than max_num_seqs full-length requests can never be in use at once; as
            # much again is kept for the prefix cache. Beyond that, memory buys nothing.
            num_blocks = min(num_blocks, 2 * config.max_num_seqs * min_blocks)
        if num_blocks < min_blocks:
            raise ValueError(
                f"KV cache of {num_blocks} blocks cannot hold one request of "
                f"max_model_len={self.max_model_len} tokens ({min_blocks} blocks of "
                f"{config.block_size}); raise the cache size or lower max_model_len"
            )
        logger.info(
            "KV cache: %d blocks of %d tokens (%.1f MiB)",
            num_blocks,
            config.block_size,
            num_blocks * per_block / 2**20,
        )
        return num_blocks


def _resolve_max_model_len(config: EngineConfig, arch: ArchConfig) -> int:
    limit, why = arch.max_position_embeddings, "max_position_embeddings"
    # Our attention is full (no sliding window); within the window the two are identical,
    # so a model trained with one (Mistral v0.1) is served up to its window only.
    if arch.sliding_window is not None and arch.sliding_window < limit:
        limit, why = arch.sliding_window, "sliding_window"
    if config.max_model_len is None:
        return limit
    if config.max_model_len > limit:
        raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's {why}={limit}")
    return config.max_model_len
