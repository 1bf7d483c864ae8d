"""What one router process sustains, and what the prefix-cache hash report costs (issue 37).

**Router ceiling.** A real :class:`~router.router.Router` behind the real gRPC ``Server`` and
``HttpServer`` runs in a process of its own, on uvloop as ``cluster/serve.py`` runs it. Its
decode workers are scripted engine loops in a second process: no model, each step emits one
token for every running request, as fast as the router reads them, through the real event
channel (``ChannelSender`` -> ``ChannelListener``); work items reach them over a control
socket (one message per request, where production makes a Ray call). The clients run in a
third process (grpc.aio streams, or raw HTTP/1.1 SSE), each stream one request after another
of ``--tokens`` output tokens. Over a window after a warm-up: output tokens/s at the
clients, the router process's CPU seconds (``/proc/<pid>/stat``: every thread, gRPC's
included) per output token, and tokens per chunk (a router behind its workers sends a
request's queued steps as one chunk; an SSE chunk's tokens are counted from its text). On a 2-core host the three processes share the cores, so the
tokens/s is what this host sustains, and ``1e6 / router_us_per_token`` what one router core
would. Left out on purpose: a prefill hop (``disaggregation: never``), the Ray driver that
shares the production router's process, and the hash sets in the workers' reports (below).
``--profile N``: one more run at N streams with cProfile on the event loop's thread, timed
by that thread's CPU clock (the host is shared: wall time would charge other processes'
turns to whatever was running); the loop's C parts (uvloop, grpc's Cython) are not in it.

**Low load.** 1 and 4 streams, the workers stepping every ``--step-ms``: per streamed chunk,
the worker's send -> the client's receipt (one clock, ``time.monotonic``), and a bare
loopback TCP one-way message between two processes for scale (a chunk crosses two hops).

**Cache report.** A real ``BlockManager`` holding 1k / 16k / 128k cached blocks under the
worker's ``ReportBuilder`` (``workers/serving/worker_report.py``): the report every step
pays (``next`` + the wire encoding), the refresh every ``HASHES_EVERY_S`` (unchanged and
changed), the report that ships the hashes, and the router's side of one (decode +
``WorkerView.update``).

    python -m bench.router_ceiling --json bench/router_ceiling_before.json
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import cProfile
import json
import multiprocessing as mp
import os
import pstats
import queue
import socket
import struct
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

from bench.cache_report import cache_report
from bench.http_vs_grpc import cpu_s
from bench.serving_cluster import Host
from bench.serving_stats import dist_ms, median_run
from workers.protocol.wire import OutputBatch, TokenEvent, WorkerReport, WorkItem, decode_as, encode

ROOT = Path(__file__).resolve().parents[1]
OUTPUT = " there lived a curious engineer who built a router"
PROMPT = "Once upon a time"
_HEADER = struct.Struct("!I")


def _tokenizer():
    from cluster.tools.make_model import build_tokenizer
    from workers.text.tokenizer import Tokenizer

    return Tokenizer(build_tokenizer("llama", 512), 0, frozenset({1, 2}))  # as the tests


def _frame(kind: bytes, payload: bytes) -> bytes:
    return _HEADER.pack(len(payload) + 1) + kind + payload


def _read_exact(stream, size: int) -> bytes:
    data = stream.read(size)
    if len(data) < size:
        raise EOFError
    return data


# ---- the workers' process ------------------------------------------------------------------
class ScriptedEngine:
    """A decode worker's engine loop without a model: each step, one token for every running
    request (``--tokens`` of them, finish ``length``), pushed as one ``OutputBatch``."""

    def __init__(self, name: str, output_ids: list[int], step_s: float, is_recording: bool):
        self.name, self.output_ids, self.step_s = name, output_ids, step_s
        self.is_recording = is_recording
        self.sent: dict[str, list[float]] = defaultdict(list)  # rid -> send time per token
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self.is_stopped = False

    def read_control(self, control: socket.socket) -> None:
        stream = control.makefile("rb")
        try:
            while True:
                (size,) = _HEADER.unpack(_read_exact(stream, _HEADER.size))
                payload = _read_exact(stream, size)
                kind, body = payload[:1], payload[1:]
                item = decode_as(body, WorkItem) if kind == b"S" else body.decode()
                self.commands.put(item)
        except (EOFError, OSError):
            self.is_stopped = True

    def run(self, sender) -> None:
        running: dict[str, list] = {}  # rid -> [prompt length, max tokens, tokens sent]
        aborted: set[str] = set()
        report = WorkerReport(self.name, "decode", True, 0, 0, 4096, 0, 0, 0)
        sender.send(OutputBatch((), report))
        ids, sent_at = self.output_ids, time.monotonic()
        while not self.is_stopped:
            try:
                block = not running
                while True:
                    command = self.commands.get(block=block, timeout=0.25 if block else None)
                    block = False
                    if isinstance(command, WorkItem):
                        params = command.params
                        running[command.request_id] = [
                            len(command.prompt_token_ids),
                            params.max_tokens,
                            0,
                        ]
                    else:
                        aborted.add(command)
            except queue.Empty:
                pass
            events = []
            for rid, state in list(running.items()):
                if rid in aborted:
                    events.append(TokenEvent(rid, (), True, "abort", num_prompt_tokens=state[0]))
                    del running[rid]
                    aborted.discard(rid)
                    continue
                num_prompt, max_tokens, i = state
                is_last = i + 1 >= max_tokens
                reason = "length" if is_last else None
                token = (ids[i % len(ids)],)
                events.append(TokenEvent(rid, token, is_last, reason, num_prompt_tokens=num_prompt))
                state[2] = i + 1
                if is_last:
                    del running[rid]
            now = time.monotonic()
            if events or now - sent_at >= 0.25:
                if self.is_recording:
                    for event in events:
                        self.sent[event.request_id].append(now)
                sender.send(OutputBatch(tuple(events), report))
                sent_at = now
            if self.step_s and running:
                time.sleep(self.step_s)


def worker_process(conn, names: list[str], output_ids: list[int], step_s: float, record: bool):
    """Scripted decode workers, one thread each; answers its control ports, then its stamps."""
    from workers.serving.channel import ChannelSender

    servers = {name: socket.create_server(("127.0.0.1", 0)) for name in names}
    conn.send({name: s.getsockname()[1] for name, s in servers.items()})
    host, port, token = conn.recv()
    engines = [ScriptedEngine(name, output_ids, step_s, record) for name in names]
    for engine in engines:
        sender = ChannelSender(host, port, engine.name, token)
        control, _ = servers[engine.name].accept()
        threading.Thread(target=engine.read_control, args=(control,), daemon=True).start()
        threading.Thread(target=engine.run, args=(sender,), daemon=True).start()
    conn.recv()  # stop: the stamps, then stay connected until the router has stopped
    conn.send({rid: t for e in engines for rid, t in e.sent.items()})
    with contextlib.suppress(EOFError):
        conn.recv()


# ---- the router's process ------------------------------------------------------------------
class ScriptedWorkerClient:
    """The router's ``WorkerClient`` of a scripted worker: work items over a control socket
    (production: a Ray call per request), events over the real event channel."""

    def __init__(self, name: str, listener, control_port: int):
        self.name, self.role = name, "decode"
        self.listener, self.control_port = listener, control_port
        self.future = listener.expect(name)
        self.channel = None
        self._control: asyncio.StreamWriter | None = None

    async def start(self) -> None:
        _, self._control = await asyncio.open_connection("127.0.0.1", self.control_port)
        self.channel = await self.listener.accepted(self.name, self.future)

    async def submit(self, item: WorkItem) -> None:
        self._control.write(_frame(b"S", encode(item)))  # the loop's transport sends it

    async def abort(self, request_id: str) -> None:
        self._control.write(_frame(b"A", request_id.encode()))

    async def decline(self, handles: tuple[bytes, ...]) -> None: ...

    def listen(self, on_batch, on_lost) -> None:
        self.channel.listen(on_batch, on_lost)

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()
        if self._control is not None:
            self._control.close()


async def _serve_router(conn, control_ports: dict[str, int], profile_path: str) -> None:
    from router.config import RouterConfig
    from router.http.server import HttpServer
    from router.router import Router
    from router.server import Server
    from workers.serving.channel import ChannelListener

    tokenizer = _tokenizer()
    listener = ChannelListener()
    await listener.start()
    clients = [ScriptedWorkerClient(n, listener, p) for n, p in control_ports.items()]
    conn.send((listener.host, listener.port, listener.token))
    config = RouterConfig(
        model_name="bench",
        architecture="LlamaForCausalLM",
        dtype="float32",
        max_model_len=4096,
        vocab_size=tokenizer.vocab_size,
        block_size=16,
        disaggregation="never",
        max_queued_requests=1 << 16,
    )
    router = Router(config, tokenizer, [], clients)
    await router.start(ready_timeout_s=60)
    grpc_server = Server(router, "127.0.0.1", 0)
    await grpc_server.start()
    http = HttpServer(router, "127.0.0.1", 0)
    await http.start()
    conn.send((grpc_server.port, http.port))
    profiler = cProfile.Profile(time.thread_time)  # CPU, not wall: the host is shared
    while (command := await asyncio.to_thread(conn.recv)) != "stop":
        if command == "profile":
            profiler.enable()  # this thread: the event loop's
        elif command == "unprofile":
            profiler.disable()
            profiler.dump_stats(profile_path)
        conn.send("ok")
    await grpc_server.stop(0.5)
    await http.stop()
    await router.stop()
    await listener.close()


def router_process(conn, control_ports: dict[str, int], profile_path: str) -> None:
    import uvloop

    uvloop.run(_serve_router(conn, control_ports, profile_path))


class Session:
    """The router's process and the workers' process, started and connected."""

    def __init__(self, args: argparse.Namespace, step_s: float, record: bool, profile_path=""):
        ctx = mp.get_context("spawn")
        names = [f"decode-{i}" for i in range(args.workers)]
        output_ids = _tokenizer().encode(OUTPUT, add_special_tokens=False)
        self.worker_conn, wc = ctx.Pipe()
        self.worker = ctx.Process(
            target=worker_process, args=(wc, names, output_ids, step_s, record)
        )
        self.worker.start()
        ports = self.worker_conn.recv()
        self.router_conn, rc = ctx.Pipe()
        self.router = ctx.Process(target=router_process, args=(rc, ports, profile_path))
        self.router.start()
        self.worker_conn.send(self.router_conn.recv())
        self.grpc_port, self.http_port = self.router_conn.recv()

    def command(self, command: str) -> None:
        self.router_conn.send(command)
        self.router_conn.recv()

    def stop(self) -> dict[str, list[float]]:
        self.worker_conn.send("stop")
        sent = self.worker_conn.recv()
        self.router_conn.send("stop")
        self.router.join(30)
        self.worker_conn.send("exit")
        self.worker.join(10)
        return sent


# ---- the clients' process ------------------------------------------------------------------
async def _grpc_stream(port: int, index: int, state: dict, max_tokens: int) -> None:
    import grpc

    from proto.baton.v1 import inference_pb2 as pb
    from proto.baton.v1 import inference_pb2_grpc as pb_grpc

    channel = state["channels"].get(index // state["per_channel"])
    if channel is None:  # a distinct argument: a connection of its own per channel
        options = [("bench.channel", index // state["per_channel"])]
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options)
        state["channels"][index // state["per_channel"]] = channel
    stub = pb_grpc.InferenceStub(channel)
    n = 0
    while not state["stop"]:
        rid = f"s{index}-{n}"
        n += 1
        req = pb.GenerateRequest(
            text=PROMPT, request_id=rid, stopping=pb.StoppingCriteria(max_tokens=max_tokens)
        )
        recv = state["recv"][rid] if state["record"] else None
        try:
            async for resp in stub.Generate(req):
                delta = resp.final.delta if resp.HasField("final") else resp.delta
                if state["counting"]:
                    state["tokens"] += len(delta.token_ids)
                    state["chunks"] += 1
                if recv is not None:  # a chunk may carry several steps' tokens
                    recv.append((time.monotonic(), len(delta.token_ids)))
        except grpc.aio.AioRpcError as exc:  # counted, not fatal: one call of thousands
            state["errors"].append(f"{exc.code().name}: {exc.details()}")
        if state["requests"] and n >= state["requests"]:
            return


def text_ends(num_tokens: int) -> list[int]:
    """Where each output token's text ends in a request's output (characters), as the
    router's detokenizer releases it: an SSE chunk has text, not token ids, and may carry
    several tokens, so the HTTP clients count tokens by the text's length."""
    from workers.text.detokenizer import IncrementalDetokenizer

    tokenizer = _tokenizer()
    ids = tokenizer.encode(OUTPUT, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode(PROMPT))
    ends, size = [], 0
    for i in range(num_tokens):
        size += len(detok.step([ids[i % len(ids)]]).text)
        ends.append(size)
    return ends


async def _http_stream(port: int, index: int, state: dict, max_tokens: int) -> None:
    """OpenAI completions with ``stream``: an SSE event per chunk, over a keep-alive
    HTTP/1.1 connection read by hand (no HTTP client library is installed)."""
    ends = state["text_ends"]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    body = json.dumps(
        {"model": "bench", "prompt": PROMPT, "max_tokens": max_tokens, "stream": True}
    ).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    while not state["stop"]:
        writer.write(head + body)
        while (await reader.readline()) != b"\r\n":  # the response's headers
            pass
        buffered, num_chars, num_tokens = b"", 0, 0
        while True:  # chunked transfer encoding
            size = int((await reader.readline()).strip(), 16)
            if size == 0:
                await reader.readline()
                break
            buffered += (await reader.readexactly(size + 2))[:-2]  # the chunk's CRLF
            *events, buffered = buffered.split(b"\n\n")
            for event in events:
                if not event.startswith(b"data: {"):
                    continue
                num_chars += len(json.loads(event[6:])["choices"][0]["text"])
                now = bisect.bisect_right(ends, num_chars)
                if state["counting"]:
                    state["tokens"] += now - num_tokens
                    state["chunks"] += 1
                num_tokens = now
    writer.close()


def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds of process ``pid``'s threads so far, summed per thread name (the event
    loop's thread is the process's name; grpc's pollers and timers have their own)."""
    out: dict[str, float] = defaultdict(float)
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):  # a thread that just ended
            stat = (task / "stat").read_text()  # /proc/<tid>/stat would be the whole process's
            fields = stat[stat.rindex(")") + 2 :].split()
            name = stat[stat.index("(") + 1 : stat.rindex(")")]
            out[name] += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


def _usage(router_pid: int, worker_pid: int) -> tuple[float, ...]:
    """Now, and the CPU seconds of the router, the workers and this client so far."""
    return time.monotonic(), cpu_s(router_pid), cpu_s(worker_pid), time.process_time()


async def _drive(args: dict, router_pid: int, worker_pid: int) -> dict:
    state = {
        "stop": False, "counting": False, "tokens": 0, "chunks": 0, "errors": [],
        "channels": {}, "per_channel": 128, "record": args["record"],
        "recv": defaultdict(list), "requests": args["requests"],
        "text_ends": text_ends(args["tokens"]) if args["frontend"] == "http" else [],
    }  # fmt: skip
    stream = _http_stream if args["frontend"] == "http" else _grpc_stream
    port = args["port"]
    tasks = [
        asyncio.create_task(stream(port, i, state, args["tokens"])) for i in range(args["streams"])
    ]
    out = {}
    if args["requests"]:  # low load: a number of requests per stream
        await asyncio.gather(*tasks)
    else:
        await asyncio.sleep(args["warmup_s"])
        state["counting"] = True
        start, threads = _usage(router_pid, worker_pid), thread_cpu_s(router_pid)
        await asyncio.sleep(args["seconds"])
        threads_end = thread_cpu_s(router_pid)
        wall, router_cpu, worker_cpu, client_cpu = (
            b - a for a, b in zip(start, _usage(router_pid, worker_pid), strict=True)
        )
        state["counting"] = False
        tokens = state["tokens"]
        state["stop"] = True
        await asyncio.gather(*tasks)
        out = {
            "output_tokens": tokens,
            "tokens_per_s": tokens / wall,
            # Chunks (messages, SSE events) the clients got: under load the router may
            # send the tokens that queued for one request as one chunk.
            "tokens_per_chunk": tokens / max(1, state["chunks"]),
            "errors": state["errors"][:5],
            "num_errors": len(state["errors"]),
            "router_us_per_token": 1e6 * router_cpu / tokens,
            "router_cores": router_cpu / wall,
            "router_threads_us_per_token": {
                name: 1e6 * (cpu - threads.get(name, 0.0)) / tokens
                for name, cpu in threads_end.items()
                if cpu - threads.get(name, 0.0) > 0
            },
            "worker_us_per_token": 1e6 * worker_cpu / tokens,
            "client_us_per_token": 1e6 * client_cpu / tokens,
        }
    for channel in state["channels"].values():
        await channel.close()
    out["recv"] = dict(state["recv"])
    return out


def client_process(conn, args: dict, router_pid: int, worker_pid: int) -> None:
    import uvloop

    conn.send(uvloop.run(_drive(args, router_pid, worker_pid)))


def run_clients(session: Session, frontend: str, streams: int, args, requests: int = 0) -> dict:
    ctx = mp.get_context("spawn")
    port = session.http_port if frontend == "http" else session.grpc_port
    spec = {
        "frontend": frontend, "port": port, "streams": streams, "tokens": args.tokens,
        "warmup_s": args.warmup, "seconds": args.seconds, "requests": requests,
        "record": bool(requests),
    }  # fmt: skip
    parent, child = ctx.Pipe()
    client = ctx.Process(
        target=client_process, args=(child, spec, session.router.pid, session.worker.pid)
    )
    client.start()
    while not parent.poll(1.0):
        if not client.is_alive():
            raise RuntimeError(f"the {frontend} clients' process died ({client.exitcode})")
    result = parent.recv()
    client.join(30)
    return result


# ---- low load: delivery per chunk -----------------------------------------------------------
def _echo(port_conn) -> None:
    server = socket.create_server(("127.0.0.1", 0))
    port_conn.send(server.getsockname()[1])
    sock, _ = server.accept()
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while data := sock.recv(64):
        sock.sendall(data)


def loopback_one_way_ms(num: int = 2000) -> dict:
    """A bare one-way loopback TCP message between two processes (half a ping-pong)."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    echo = ctx.Process(target=_echo, args=(child,))
    echo.start()
    sock = socket.create_connection(("127.0.0.1", parent.recv()))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    halves = []
    for _ in range(num):
        t = time.monotonic()
        sock.sendall(b"x" * 32)
        sock.recv(64)
        halves.append((time.monotonic() - t) / 2)
    sock.close()
    echo.join(10)
    return dist_ms(halves)


def low_load(args, streams: int) -> dict:
    session = Session(args, args.step_ms / 1e3, record=True)
    try:
        result = run_clients(session, "grpc", streams, args, requests=args.latency_requests)
    finally:
        sent = session.stop()
    delivery, num_tokens = [], 0
    for rid, recv in result["recv"].items():
        sends = sent.get(rid, [])
        for received, num in recv:  # each chunk: from its last token's send
            num_tokens += num
            if num and num_tokens <= len(sends):
                delivery.append(received - sends[num_tokens - 1])
        num_tokens = 0
    num_chunks = sum(1 for recv in result["recv"].values() for _, num in recv if num)
    return {
        "streams": streams,
        "delivery_ms": dist_ms(delivery),
        "num_chunks": len(delivery),
        "tokens_per_chunk": sum(len(s) for s in sent.values()) / max(1, num_chunks),
    }


# ---- the cache report -------------------------------------------------------------------------
# ---- the machine, and main ------------------------------------------------------------------
def machine() -> dict:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next(
        (ln.split(":", 1)[1].strip() for ln in lscpu.splitlines() if "Model name" in ln), ""
    )
    git = ["git", "-C", str(ROOT)]
    if (ROOT / ".git").exists():
        commit = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True)
        dirty = subprocess.run([*git, "status", "--porcelain"], capture_output=True, text=True)
        commit_id, changed = commit.stdout.strip(), dirty.stdout.splitlines()
    else:  # a tree exported with ``git archive`` (a shared checkout's HEAD, clean)
        commit_id, changed = os.environ.get("BENCH_COMMIT", "unknown (no .git)"), []
    return {
        "cpu_model": model,
        "num_cpus": os.cpu_count(),
        "commit": commit_id,
        "changed_files": changed,
        "python": sys.version.split()[0],
    }


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def top_functions(path: str, num: int) -> dict[str, list[dict]]:
    """The event loop thread's profile: the ``num`` functions with the most own time, and
    own time summed per file (per package outside the repository; C builtins by name)."""
    stats = pstats.Stats(path).stats  # type: ignore[attr-defined]
    total = sum(row[2] for row in stats.values())
    by_file: dict[str, float] = defaultdict(float)
    for (file, _, name), (_, _, tt, _, _) in stats.items():
        if file == "~":
            where = name
        elif "site-packages/" in file:
            where = file.split("site-packages/", 1)[1].split("/", 1)[0]
        elif file.startswith(str(ROOT)):
            where = str(Path(file).relative_to(ROOT))
        else:
            where = "stdlib " + Path(file).name
        by_file[where] += tt
    rows = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)
    return {
        "functions": [
            {
                "function": f"{Path(file).name}:{line} {name}",
                "own_share": round(tt / total, 4),
                "cum_share": round(ct / total, 4),
                "ncalls": nc,
            }
            for (file, line, name), (_, nc, tt, ct, _) in rows[:num]
        ],
        "files": [
            {"file": where, "own_share": round(tt / total, 4)}
            for where, tt in sorted(by_file.items(), key=lambda kv: kv[1], reverse=True)[:num]
        ],
    }


class _ChainWorker:
    """A WorkerClient in the router's own process: takes work, sends what it is told."""

    name, role = "decode-0", "decode"

    def __init__(self) -> None:
        self.items: list[WorkItem] = []
        self.on_batch = None

    async def start(self) -> None: ...

    def listen(self, on_batch, on_lost) -> None:
        self.on_batch = on_batch
        self.send(())

    def close(self) -> None: ...

    async def submit(self, item: WorkItem) -> None:
        self.items.append(item)

    async def abort(self, request_id: str) -> None: ...

    async def decline(self, handles: tuple[bytes, ...]) -> None: ...

    def send(self, events) -> None:
        report = WorkerReport(self.name, "decode", True, 0, 0, 4096, 0, 0, 0)
        self.on_batch(OutputBatch(tuple(events), report))


async def _chain(streams: int, tokens: int) -> float:
    """One run of ``chain``: thread CPU seconds per streamed token."""
    from router.config import RouterConfig
    from router.requests import GenerateRequest, StoppingOptions
    from router.router import Router

    tokenizer = _tokenizer()
    output_ids = tokenizer.encode(OUTPUT, add_special_tokens=False)
    config = RouterConfig(
        "bench",
        "LlamaForCausalLM",
        "float32",
        4096,
        tokenizer.vocab_size,
        16,
        disaggregation="never",
    )
    worker = _ChainWorker()
    router = Router(config, tokenizer, [], [worker])
    await router.start(ready_timeout_s=10)
    loop = asyncio.get_running_loop()
    state = {"left": streams, "step": loop.create_future()}

    async def consume(stream) -> None:
        async for _event in stream:
            state["left"] -= 1
            if not state["left"]:
                state["step"].set_result(None)

    stopping = StoppingOptions(max_tokens=tokens, ignore_eos=True)
    reqs = [GenerateRequest(PROMPT, f"c{i}", stopping=stopping) for i in range(streams)]
    tasks = [loop.create_task(consume(router.generate(r))) for r in reqs]
    while len(worker.items) < streams:
        await asyncio.sleep(0.001)
    ids = [item.request_id for item in worker.items]
    started = time.thread_time()
    for step in range(tokens):
        is_last = step == tokens - 1
        token = (output_ids[step % len(output_ids)],)
        reason = "length" if is_last else None
        state["left"], state["step"] = streams, loop.create_future()
        worker.send([TokenEvent(rid, token, is_last, finish_reason=reason) for rid in ids])
        await state["step"]  # every stream read this step's token: the router keeps up
    cpu_s = time.thread_time() - started
    await asyncio.gather(*tasks)
    await router.stop()
    return cpu_s / (streams * tokens)


def chain(streams: int, tokens: int, repeats: int) -> dict:
    """The router's own per-token path, alone: in one process, on uvloop, no front end and
    no channel, a worker's batch with one token for each of ``streams`` requests goes
    through the router's intake, the request's stream and its generators to the reader,
    step after step, each step read to the end before the next (the router keeps up: a
    chunk per token). The event loop thread's CPU time per token (the batch's and the
    events' construction included, the same for any router)."""
    import uvloop

    runs = [uvloop.run(_chain(streams, tokens)) for _ in range(repeats)]
    return {"streams": streams, "tokens": tokens, "us_per_token": [1e6 * r for r in runs]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=_ints, default=[256, 1024], help="concurrent streams")
    parser.add_argument("--http-streams", type=_ints, default=[256], help="SSE streams ('' none)")
    parser.add_argument("--tokens", type=int, default=128, help="output tokens per request")
    parser.add_argument("--seconds", type=float, default=10.0, help="measured window per run")
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds before the window")
    parser.add_argument("--repeats", type=int, default=3, help="runs per setting (medians)")
    parser.add_argument("--workers", type=int, default=1, help="scripted decode workers")
    parser.add_argument("--low-streams", type=_ints, default=[1, 4])
    parser.add_argument("--latency-requests", type=int, default=8, help="per stream, low load")
    parser.add_argument("--step-ms", type=float, default=10.0, help="worker step at low load")
    parser.add_argument(
        "--ceiling-step-ms",
        type=float,
        default=0.0,
        help="worker step for the ceiling (0: no pause; a worker far ahead of the router "
        "then finishes each request alone, in batches of a token or two)",
    )
    parser.add_argument("--blocks", type=_ints, default=[1024, 16384, 131072])
    parser.add_argument("--step-rate", type=float, default=50.0, help="worker steps/s")
    parser.add_argument("--profile", type=int, default=256, help="cProfile at N streams (0 off)")
    parser.add_argument("--quiet-wait", type=float, default=10.0, help="wait for a quiet host")
    parser.add_argument("--json", type=Path, help="write every run and the medians")
    parser.add_argument(
        "--chain", type=int, default=0, help="only the in-process per-token path at N streams"
    )
    args = parser.parse_args(argv)
    if args.chain:
        doc = {"load_before": os.getloadavg(), "machine": machine()}
        doc["chain"] = chain(args.chain, args.tokens, args.repeats)
        print(json.dumps(doc["chain"]), flush=True)
        if args.json:
            args.json.write_text(json.dumps(doc, indent=1))
        return 0

    doc: dict = {"arguments": {k: str(v) for k, v in vars(args).items()}, "machine": machine()}
    doc["load_before"] = {}

    def phase(name: str) -> None:
        doc["load_before"][name] = os.getloadavg()
        print(f"[{name}] load {os.getloadavg()[0]:.2f}", flush=True)

    # Router ceiling: one session, the settings alternating within each repeat.
    settings = [("grpc", s) for s in args.streams] + [("http", s) for s in args.http_streams]
    runs: dict[str, list[dict]] = defaultdict(list)
    phase("ceiling")
    host = Host()
    session = Session(args, args.ceiling_step_ms / 1e3, record=False)
    try:
        run_clients(session, "grpc", 64, argparse.Namespace(**{**vars(args), "seconds": 1.0}))
        for repeat in range(args.repeats):
            for frontend, streams in settings:
                key = f"{frontend}_{streams}"
                run_quiet = host.wait_quiet(args.quiet_wait)
                phase(f"{key}#{repeat}")
                started = host.sample()
                run = run_clients(session, frontend, streams, args)
                run.pop("recv")
                run["load1"] = os.getloadavg()[0]
                run["foreign_cores_before"] = run_quiet  # others' use in the last 2 s
                run["foreign_core_s"] = host.foreign_s(started)  # others' use during the run
                runs[key].append(run)
                print(
                    f"{key} #{repeat}: {run['tokens_per_s']:.0f} tok/s, router "
                    f"{run['router_us_per_token']:.1f} CPU-us/token ({run['router_cores']:.2f} "
                    f"cores), worker {run['worker_us_per_token']:.1f}, client "
                    f"{run['client_us_per_token']:.1f}; {run['tokens_per_chunk']:.2f} tokens "
                    f"per chunk, {run['num_errors']} errors; others used "
                    f"{run['foreign_core_s']:.1f} core-s",
                    flush=True,
                )
    finally:
        session.stop()
    doc["ceiling_runs"] = runs
    doc["ceiling"] = {key: median_run(rs) for key, rs in runs.items()}

    if args.profile:
        phase("profile")
        path = str(Path(os.environ.get("TMPDIR", "/tmp")) / f"router_ceiling_{os.getpid()}.prof")
        session = Session(args, args.ceiling_step_ms / 1e3, record=False, profile_path=path)
        try:
            session.command("profile")
            profiled = run_clients(session, "grpc", args.profile, args)
            session.command("unprofile")
        finally:
            session.stop()
        profiled.pop("recv")
        doc["profile"] = {"streams": args.profile, "run": profiled, "top": top_functions(path, 15)}
        for row in doc["profile"]["top"]["functions"]:
            print(f"| {100 * row['own_share']:5.1f}% | {row['function']}")
        for row in doc["profile"]["top"]["files"]:
            print(f"| {100 * row['own_share']:5.1f}% | {row['file']}")

    phase("low_load")
    doc["loopback_one_way_ms"] = loopback_one_way_ms()
    doc["low_load"] = [low_load(args, s) for s in args.low_streams]
    hops_ms = 2 * doc["loopback_one_way_ms"]["p50"]  # worker -> router -> client
    for row in doc["low_load"]:
        row["router_overhead_p50_ms"] = row["delivery_ms"]["p50"] - hops_ms
        print(f"low load {row['streams']} streams: delivery {row['delivery_ms']}", flush=True)
    print(f"loopback one-way: {doc['loopback_one_way_ms']}")

    phase("cache_report")
    doc["cache_report"] = [cache_report(n, args.step_rate, 0.5) for n in args.blocks]
    for row in doc["cache_report"]:
        print({k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
    doc["load_after"] = os.getloadavg()
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
