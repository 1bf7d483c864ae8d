"""``LLM``: the single-process Python API (``baton generate --model``), no Ray involved."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import fields

from tqdm import tqdm

from workers.engine.config import EngineConfig
from workers.engine.llm_engine import LLMEngine
from workers.engine.outputs import CompletionOutput, StreamDelta
from workers.engine.request import FinishReason
from workers.protocol.logprobs import TokenLogprobs
from workers.protocol.sampling_params import SamplingParams

Prompt = str | Sequence[int]


class LLM:
    """Offline generation over the paged, continuously batched engine.

    ``LLM("dir", dtype="float32", max_num_seqs=32, ...)`` takes every
    ``EngineConfig`` field as a keyword. Not thread-safe: one caller drives it at a time
    (a ``generate`` call, or one ``stream`` iterated to its end or closed).
    """

    def __init__(self, model: str, **engine_args: object):
        known = {f.name for f in fields(EngineConfig)}
        unknown = sorted(set(engine_args) - known)
        if unknown:
            raise ValueError(f"unknown LLM argument(s): {', '.join(unknown)}")
        self.engine = LLMEngine(EngineConfig(model=str(model), **engine_args))  # type: ignore[arg-type]
        self.tokenizer = self.engine.tokenizer
        self._counter = 0

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[CompletionOutput]:
        """Generate for every prompt (strings or token-id lists); outputs in prompt order."""
        prompt_list = _as_prompt_list(prompts)
        if params is None:
            params = SamplingParams()
        params_list = (
            [params] * len(prompt_list) if isinstance(params, SamplingParams) else list(params)
        )
        if len(params_list) != len(prompt_list):
            raise ValueError(
                f"params: got {len(params_list)} SamplingParams for {len(prompt_list)} prompts"
            )
        order: list[str] = []
        try:
            for prompt, p in zip(prompt_list, params_list, strict=True):
                order.append(self.engine.add_request(prompt, p, self._next_id()))
        except ValueError:
            self.engine.abort_request(order)
            self._drain()
            raise
        prompt_ids = {r: tuple(self.engine.scheduler.requests[r].prompt_token_ids) for r in order}
        collected: dict[str, list[StreamDelta]] = {r: [] for r in order}
        done: dict[str, CompletionOutput] = {}
        with tqdm(total=len(order), disable=not use_tqdm, desc="generate") as bar:
            try:
                while len(done) < len(order):
                    for delta in self.engine.step():
                        if delta.request_id not in collected:
                            continue  # e.g. the final of an earlier, abandoned stream
                        collected[delta.request_id].append(delta)
                        if delta.finished:
                            done[delta.request_id] = _completion(
                                prompt_ids[delta.request_id], collected.pop(delta.request_id)
                            )
                            bar.update(1)
            except BaseException:
                self.engine.abort_request([r for r in order if r not in done])
                self._drain()
                raise
        return [done[r] for r in order]

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[StreamDelta]:
        """Yield one request's deltas as they are produced; the last has ``finished=True``.

        Leaving the loop early (break, exception) aborts the request.
        """
        request_id = self.engine.add_request(prompt, params or SamplingParams(), self._next_id())
        finished = False
        try:
            while not finished:
                for delta in self.engine.step():
                    if delta.request_id == request_id:
                        finished = delta.finished
                        yield delta
        finally:
            if not finished:
                self.engine.abort_request(request_id)
                self._drain()

    def _drain(self) -> None:
        """Run the engine until aborted requests have released everything."""
        while self.engine.has_unfinished_requests() and not self.engine.scheduler.requests:
            self.engine.step()

    def _next_id(self) -> str:
        self._counter += 1
        return f"llm-{self._counter}"


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, Sequence) and prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # a single list of token ids
    return list(prompts)  # type: ignore[arg-type]


def _completion(prompt_ids: tuple[int, ...], deltas: list[StreamDelta]) -> CompletionOutput:
    last = deltas[-1]
    logprobs: tuple[TokenLogprobs, ...] | None = None
    if any(d.logprobs is not None for d in deltas):
        logprobs = tuple(lp for d in deltas for lp in (d.logprobs or ()))
    prompt = next((d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None), None)
    return CompletionOutput(
        request_id=last.request_id,
        prompt_token_ids=prompt_ids,
        token_ids=tuple(t for d in deltas for t in d.token_ids),
        text="".join(d.text for d in deltas),
        finish_reason=last.finish_reason or FinishReason.ABORT,
        stop_reason=last.stop_reason,
        logprobs=logprobs,
        num_cached_tokens=last.num_cached_tokens,
        prompt_logprobs=None if prompt is None else (None, *prompt),
    )
