"""Router CPU per worker event, one token each, with no backlog to merge (issue 37).

``bench/router_ceiling.py`` measures a whole router process; at its ceiling the events of a
request that queued up go out as one chunk, so its figure mixes per-chunk and per-token
work. This one times the three per-event stages alone, in this process, by thread CPU time:
``RequestStream.on_event`` (bookkeeping and the detokenizer), ``CallMetrics.event`` and
``generate_response`` with the protobuf serialization; 128-token requests with the
ceiling's prompt, output and test tokenizer. Median of ``--repeats``.

    python -m bench.router_per_event
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from bench.router_ceiling import OUTPUT, PROMPT, _tokenizer
from router.metrics import RouterMetrics
from router.server import generate_response
from router.stream import RequestStream
from workers.protocol.sampling_params import SamplingParams
from workers.protocol.wire import TokenEvent

NUM_TOKENS = 128


def run_once(num_requests: int) -> dict[str, float]:
    tokenizer = _tokenizer()
    ids = tokenizer.encode(OUTPUT, add_special_tokens=False)
    prompt = tokenizer.encode(PROMPT)
    params = SamplingParams(max_tokens=NUM_TOKENS)
    metrics = RouterMetrics("per-event")
    events = [
        [
            TokenEvent(
                f"r{r}",
                (ids[i % len(ids)],),
                i == NUM_TOKENS - 1,
                "length" if i == NUM_TOKENS - 1 else None,
            )
            for i in range(NUM_TOKENS)
        ]
        for r in range(num_requests)
    ]
    start = time.thread_time()
    outs = []
    for r, request_events in enumerate(events):
        stream = RequestStream(
            f"r{r}", prompt, params, tokenizer, return_text=True, return_timing=False
        )
        outs.append([stream.on_event(e) for e in request_events])
    streamed = time.thread_time()
    for request_outs in outs:
        call = metrics.call()
        for out in request_outs:
            call.event(out)
        call.closed()
    counted = time.thread_time()
    for request_outs in outs:
        for out in request_outs:
            generate_response(out).SerializeToString()
    encoded = time.thread_time()
    num = num_requests * NUM_TOKENS
    return {
        "stream_us": 1e6 * (streamed - start) / num,
        "metrics_us": 1e6 * (counted - streamed) / num,
        "grpc_us": 1e6 * (encoded - counted) / num,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    run_once(20)  # warm: imports, the tokenizer's caches
    runs = [run_once(args.requests) for _ in range(args.repeats)]
    print(json.dumps({k: round(statistics.median(r[k] for r in runs), 2) for k in runs[0]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
