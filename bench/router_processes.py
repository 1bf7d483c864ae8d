"""Tokens/s of N router processes against one (``router.processes``, issue 37).

The setting of ``bench/router_ceiling.py`` (scripted decode workers that emit a token per
running request per step, no model; real ``Router`` and gRPC ``Server`` on uvloop; the
clients in a process of their own), with N router processes on one gRPC port
(SO_REUSEPORT, as ``cluster/serve.py`` binds it) instead of one. Each scripted worker
opens an event channel to every router process and sends each request's tokens on the
channel of the process that submitted it, its report on all of them
(``workers/serving/sinks.py``, the workers' own code); each process has a control socket to each worker
(production: a Ray call, made by the first process for the others, one per request).
The clients spread their streams over ``--connections`` gRPC connections, which the
kernel spreads over the processes (SO_REUSEPORT hashes each connection). Over a window
after a warm-up: output tokens/s at the clients, and the router processes' CPU seconds
(all of them, ``/proc/<pid>/stat``) per output token. Left out: the first process's hop
for the others' submits (one local message per request of ``--tokens`` tokens), Ray.

    python -m bench.router_processes --processes 1,2 --json /tmp/router_processes.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import json
import multiprocessing as mp
import os
import queue
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.http_vs_grpc import cpu_s
from bench.router_ceiling import (
    OUTPUT,
    PROMPT,
    ScriptedWorkerClient,
    _tokenizer,
    machine,
    top_functions,
)
from workers.protocol.wire import OutputBatch, TokenEvent, WorkerReport, WorkItem


# ---- the workers' process ------------------------------------------------------------------
def _read_control(control: socket.socket, router: int, commands: queue.SimpleQueue) -> None:
    from bench.router_ceiling import _HEADER, _read_exact
    from workers.protocol.wire import decode_as

    stream = control.makefile("rb")
    try:
        while True:
            (size,) = _HEADER.unpack(_read_exact(stream, _HEADER.size))
            payload = _read_exact(stream, size)
            body = payload[1:]
            item = decode_as(body, WorkItem) if payload[:1] == b"S" else body.decode()
            commands.put((router, item))
    except (EOFError, OSError):
        commands.put((router, None))


def _engine(name: str, senders: list, commands: queue.SimpleQueue, ids: list[int]) -> None:
    """A scripted decode engine loop: each step one token per running request, sent on its
    router's channel; the report on every channel. Ends when a router goes (the end)."""
    with contextlib.suppress(OSError):
        _steps(name, senders, commands, ids)


def _steps(name: str, senders: list, commands: queue.SimpleQueue, ids: list[int]) -> None:
    from workers.serving.sinks import Sinks

    sinks = Sinks()  # the worker's own rule: events to their router, reports to all
    for router, sender in enumerate(senders):
        sinks.attach(router, sender.send)
    running: dict[str, list] = {}  # rid -> [prompt length, max tokens, sent]
    report = WorkerReport(name, "decode", True, 0, 0, 4096, 0, 0, 0)
    for sender in senders:
        sender.send(OutputBatch((), report))
    sent_at, num_closed = time.monotonic(), 0
    while num_closed < len(senders):
        events: list[TokenEvent] = []
        try:
            block = not running
            while True:
                router, item = commands.get(block=block, timeout=0.25 if block else None)
                block = False
                if item is None:
                    num_closed += 1
                elif isinstance(item, WorkItem):
                    sinks.own(item.request_id, router)
                    params = item.params
                    running[item.request_id] = [len(item.prompt_token_ids), params.max_tokens, 0]
                elif item in running:  # an abort
                    del running[item]
                    events.append(TokenEvent(item, (), True, "abort"))
        except queue.Empty:
            pass
        for rid, state in list(running.items()):
            num_prompt, max_tokens, i = state
            is_last = i + 1 >= max_tokens
            token = (ids[i % len(ids)],)
            events.append(
                TokenEvent(rid, token, is_last, "length" if is_last else None,
                           num_prompt_tokens=num_prompt)
            )  # fmt: skip
            state[2] = i + 1
            if is_last:
                del running[rid]
        now = time.monotonic()
        if events or now - sent_at >= 0.25:
            report = WorkerReport(name, "decode", True, len(running), 0, 4096, 0, 0, 0)
            for _, sink, mine in sinks.split(events, report, now):
                sink(OutputBatch(mine, report))
            sent_at = now


def worker_process(conn, names: list[str], num_routers: int, output_ids: list[int]) -> None:
    from workers.serving.channel import ChannelSender

    servers = {
        (n, r): socket.create_server(("127.0.0.1", 0)) for n in names for r in range(num_routers)
    }
    conn.send({r: {n: servers[(n, r)].getsockname()[1] for n in names} for r in range(num_routers)})
    listeners = conn.recv()  # [(host, port, token)] per router process
    for name in names:
        senders = [ChannelSender(host, port, name, token) for host, port, token in listeners]
        commands: queue.SimpleQueue = queue.SimpleQueue()
        for router in range(num_routers):
            control, _ = servers[(name, router)].accept()
            args = (control, router, commands)
            threading.Thread(target=_read_control, args=args, daemon=True).start()
        args = (name, senders, commands, output_ids)
        threading.Thread(target=_engine, args=args, daemon=True).start()
    conn.recv()  # stop


# ---- a router process ------------------------------------------------------------------------
class _Prefix:
    """router.group.RouterGroup reduced to the id prefix (the bench's ids never meet)."""

    def __init__(self, index: int):
        self.id_prefix = f"r{index}:"

    async def abort_elsewhere(self, request_id: str, principal: str) -> bool:
        return False

    async def worker_joined(self, name: str, role: str) -> None: ...

    def worker_left(self, name: str) -> None: ...


async def _serve_router(
    conn, index: int, num_routers: int, control_ports: dict, profile_path: str
) -> None:
    from router.config import RouterConfig
    from router.router import Router
    from router.server import Server
    from workers.serving.channel import ChannelListener

    tokenizer = _tokenizer()
    listener = ChannelListener()
    await listener.start()
    clients = [ScriptedWorkerClient(n, listener, p) for n, p in control_ports.items()]
    conn.send((listener.host, listener.port, listener.token))
    config = RouterConfig(
        model_name="bench", architecture="LlamaForCausalLM", dtype="float32",
        max_model_len=4096, vocab_size=tokenizer.vocab_size, block_size=16,
        disaggregation="never", max_queued_requests=1 << 16,
    )  # fmt: skip
    router = Router(config, tokenizer, [], clients)
    if num_routers > 1:
        router.join_group(_Prefix(index))
    await router.start(ready_timeout_s=60)
    port = await asyncio.to_thread(conn.recv)  # 0 for the first: any free port
    server = Server(router, "127.0.0.1", port, reuse_port=num_routers > 1)
    await server.start()
    conn.send(server.port)
    profiler = cProfile.Profile(time.thread_time)  # CPU, not wall: the host is shared
    if profile_path:
        profiler.enable()  # this thread: the event loop's, from now to the stop
    await asyncio.to_thread(conn.recv)  # stop
    if profile_path:
        profiler.disable()
        profiler.dump_stats(profile_path)
    await server.stop(0.5)
    await router.stop()
    await listener.close()


def router_process(
    conn, index: int, num_routers: int, control_ports: dict, profile_path: str
) -> None:
    import uvloop

    uvloop.run(_serve_router(conn, index, num_routers, control_ports, profile_path))


# ---- the clients' process --------------------------------------------------------------------
async def _stream(stub, index: int, state: dict, max_tokens: int) -> None:
    from proto.baton.v1 import inference_pb2 as pb

    n = 0
    while not state["stop"]:
        rid = f"s{index}-{n}"
        n += 1
        stopping = pb.StoppingCriteria(max_tokens=max_tokens)
        request = pb.GenerateRequest(text=PROMPT, request_id=rid, stopping=stopping)
        async for resp in stub.Generate(request):
            delta = resp.final.delta if resp.HasField("final") else resp.delta
            if state["counting"]:
                state["tokens"] += len(delta.token_ids)


async def _drive(spec: dict) -> dict:
    import grpc

    from proto.baton.v1 import inference_pb2_grpc as pb_grpc

    state = {"stop": False, "counting": False, "tokens": 0}
    channels = [
        grpc.aio.insecure_channel(f"127.0.0.1:{spec['port']}", options=[("bench.conn", i)])
        for i in range(spec["connections"])
    ]  # a distinct argument each: a connection each, which the kernel gives some process
    stubs = [pb_grpc.InferenceStub(c) for c in channels]
    tasks = [
        asyncio.create_task(_stream(stubs[i % len(stubs)], i, state, spec["tokens"]))
        for i in range(spec["streams"])
    ]
    await asyncio.sleep(spec["warmup_s"])
    pids = spec["router_pids"]
    start_cpu = [cpu_s(p) for p in pids]
    start_others = cpu_s(spec["worker_pid"]), time.process_time()
    start, state["counting"] = time.monotonic(), True
    await asyncio.sleep(spec["seconds"])
    wall, tokens = time.monotonic() - start, state["tokens"]
    router_cpu = [cpu_s(p) - c for p, c in zip(pids, start_cpu, strict=True)]
    worker_cpu = cpu_s(spec["worker_pid"]) - start_others[0]
    client_cpu = time.process_time() - start_others[1]
    state["stop"] = True
    await asyncio.gather(*tasks, return_exceptions=True)
    for channel in channels:
        await channel.close()
    return {
        "output_tokens": tokens,
        "tokens_per_s": tokens / wall,
        "router_us_per_token": 1e6 * sum(router_cpu) / tokens,
        "router_cores_each": [c / wall for c in router_cpu],
        # What else the host's cores went to: the scripted workers and the clients.
        "worker_cores": worker_cpu / wall,
        "client_cores": client_cpu / wall,
    }


def client_process(conn, spec: dict) -> None:
    import uvloop

    conn.send(uvloop.run(_drive(spec)))


# ---- main ----------------------------------------------------------------------------------
def measure(num_routers: int, args, profile_dir: str = "") -> dict:
    """One run; with ``profile_dir``, router process 0's event loop under cProfile."""
    ctx = mp.get_context("spawn")
    names = [f"decode-{i}" for i in range(args.workers)]
    output_ids = _tokenizer().encode(OUTPUT, add_special_tokens=False)
    worker_conn, wc = ctx.Pipe()
    worker = ctx.Process(target=worker_process, args=(wc, names, num_routers, output_ids))
    worker.start()
    ports = worker_conn.recv()
    routers, conns = [], []
    for index in range(num_routers):
        parent, child = ctx.Pipe()
        path = (
            f"{profile_dir}/router_{num_routers}_{index}.prof" if profile_dir and not index else ""
        )
        proc = ctx.Process(
            target=router_process, args=(child, index, num_routers, ports[index], path)
        )
        proc.start()
        routers.append(proc)
        conns.append(parent)
    worker_conn.send([c.recv() for c in conns])
    conns[0].send(0)
    port = conns[0].recv()
    for c in conns[1:]:
        c.send(port)
        c.recv()
    try:
        spec = {
            "port": port, "streams": args.streams, "connections": args.connections,
            "tokens": args.tokens, "warmup_s": args.warmup, "seconds": args.seconds,
            "router_pids": [p.pid for p in routers], "worker_pid": worker.pid,
        }  # fmt: skip
        parent, child = ctx.Pipe()
        client = ctx.Process(target=client_process, args=(child, spec))
        client.start()
        result = parent.recv()
        client.join(30)
    finally:
        for c in conns:
            c.send("stop")
        for proc in routers:
            proc.join(30)
        worker_conn.send("stop")
        worker.join(10)
    result["load1"] = os.getloadavg()[0]
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", default="1,2", help="router processes to compare")
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--connections", type=int, default=16, help="gRPC connections")
    parser.add_argument("--tokens", type=int, default=128, help="output tokens per request")
    parser.add_argument("--workers", type=int, default=2, help="scripted decode workers")
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--repeats", type=int, default=3, help="runs per setting (alternating)")
    parser.add_argument("--profile", action="store_true", help="one more run each, profiled")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    counts = [int(v) for v in args.processes.split(",")]
    doc: dict = {"arguments": vars(args) | {"json": str(args.json)}, "machine": machine()}
    doc["load_before"] = os.getloadavg()
    runs: dict[int, list[dict]] = {n: [] for n in counts}
    for repeat in range(args.repeats):
        for n in counts:
            run = measure(n, args)
            runs[n].append(run)
            print(f"processes={n} #{repeat}: {run['tokens_per_s']:.0f} tok/s, router "
                  f"{run['router_us_per_token']:.1f} CPU-us/token, cores each "
                  f"{[round(c, 2) for c in run['router_cores_each']]}, workers "
                  f"{run['worker_cores']:.2f}, clients {run['client_cores']:.2f} cores, load "
                  f"{run['load1']:.2f}", flush=True)  # fmt: skip
    doc["runs"] = runs
    doc["median_tokens_per_s"] = {
        n: sorted(r["tokens_per_s"] for r in rs)[len(rs) // 2] for n, rs in runs.items() if rs
    }
    if args.profile:  # where process 0's event loop spends its CPU, at each N
        profile_dir = tempfile.mkdtemp()
        doc["profile"] = {}
        for n in counts:
            measure(n, args, profile_dir)
            top = top_functions(f"{profile_dir}/router_{n}_0.prof", 12)
            doc["profile"][n] = top
            for row in top["functions"]:
                print(f"N={n} | {100 * row['own_share']:5.1f}% | {row['function']}")
    doc["load_after"] = os.getloadavg()
    print(json.dumps(doc["median_tokens_per_s"]))
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
