"""Serve a cluster config until SIGTERM/SIGINT, then drain: ``baton serve`` and
``python -m cluster``.

The router serves gRPC and, with ``router.http_port`` set (default 8000), the
OpenAI-compatible HTTP API (``router/http/``) in the same event loop: two front ends over
one ``Router``. With ``router.processes: N`` > 1 this process starts N-1 more router
processes on the same ports (SO_REUSEPORT; ``cluster/router_hub.py``, docs/serving.md
"Several router processes"), drains them with its own and stops them before the workers.

Drain: readiness goes NOT_SERVING (HTTP ``/health`` 503) and new requests get UNAVAILABLE
(HTTP 503); requests in flight may finish within ``router.drain_grace_seconds``, the rest
are aborted; then the HTTP and gRPC servers stop, every worker stops (leases released) and a Ray instance we started is
shut down, so nothing is left running.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import signal
import sys
from collections.abc import Callable
from pathlib import Path

from cluster.config import ClusterConfig

logger = logging.getLogger(__name__)

_HEAD_POLL_S = 0.05  # how often the drain checks that Ray's processes still run
_HEAD_WATCH_S = 1.0  # and for how long at least (a process takes a moment to die)
_FRONT_END_STOP_S = 2.0  # closing the front ends when Ray died with us
_RAY_STOP_S = 30.0  # stopping the workers, and Ray, at most (a backstop: slow when loaded)
_HEAD_GONE = (
    "baton: Ray's processes got the signal too (a process group or cgroup kill): "
    "its workers are gone, exiting without a drain"
)


def run(config: ClusterConfig) -> int:
    """Serve on uvloop where it is installed (it is a dependency on Linux and macOS).

    Why: every streamed chunk crosses the event loop twice (the worker's event channel in,
    gRPC out); on the development VM uvloop took a socket read to the coroutine in 0.14 ms
    against 0.27 ms for asyncio's default loop (p50), within a 1 ms per-chunk budget.
    """
    ray_token_authentication(os.environ)
    try:
        import uvloop
    except ImportError:
        return asyncio.run(serve(config))
    return uvloop.run(serve(config))


def ray_token_authentication(environ) -> bool:
    """Turn on Ray's token authentication (a fresh random token) when this process is
    about to start a Ray instance of its own: its GCS and raylet listen on ports any
    local user can reach, and an unauthenticated Ray runs any code it is sent
    (docs/security.md). Ray reads the mode when it is imported, so this runs before
    anything imports it; it decides as ``cluster/bringup.py`` will: ``RAY_ADDRESS=local``,
    or no address and no running local instance recorded. An explicit ``RAY_AUTH_MODE``
    is left alone, as is a Ray that joins a cluster (whose token is the cluster's).
    Returns whether it turned it on."""
    if environ.get("RAY_AUTH_MODE") or "ray" in sys.modules:
        return False
    address = environ.get("RAY_ADDRESS", "")
    current = Path(environ.get("RAY_TMPDIR", "/tmp")) / "ray" / "ray_current_cluster"
    if address == "local" or (not address and not current.exists()):
        environ["RAY_AUTH_MODE"] = "token"
        environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))
        return True
    return False


async def serve(config: ClusterConfig, on_ready: Callable[[str], None] | None = None) -> int:
    """Bring the cluster up, serve until a signal, drain. Returns the exit code."""
    from cluster.bringup import bring_up
    from router.server import Server

    loop = asyncio.get_running_loop()
    http = None
    # Blocking, on purpose: nothing else runs yet, and Ray installs its signal handlers
    # only when initialised from the main thread.
    # Refused before anything starts: a keys file or TLS file that cannot be read.
    keys = api_keys(config)
    admin = admin_key(config)
    tls = config.router.tls()
    if tls is not None:
        tls.grpc_credentials()
        tls.uvicorn_options()
    num_processes = config.router.processes
    if num_processes > 1 and config.planner.enabled:
        # The planner's feed is the first process's requests only (cluster/planner_loop.py).
        raise ValueError("router.processes > 1 and planner.enabled: choose one (not yet both)")
    if num_processes > 1 and admin is not None:
        # Live scaling runs in the first process; an admin call may reach any of them.
        raise ValueError("router.processes > 1 and an admin key (baton scale): not yet both")
    cluster = bring_up(config)
    server = hub = None
    try:
        router = cluster.router
        if num_processes > 1:
            hub = _router_hub(config, cluster)
        await router.start()
        tp_pp = {
            "prefill": (config.prefill.tensor_parallel, config.prefill.pipeline_parallel),
            "decode": (config.decode.tensor_parallel, config.decode.pipeline_parallel),
        }
        shared = num_processes > 1  # SO_REUSEPORT: the other processes bind these ports too
        args = (router, config.router.host, config.router.port, tp_pp, keys, tls)
        server = Server(*args, reuse_port=shared)
        await server.start()
        if config.router.http_port:
            http = _http_server(config, router, keys, admin, reuse_port=shared)
            await http.start()
        if hub is not None:
            await hub.start(server.port, http.port if http is not None else 0)
            print(f"baton: {num_processes} router processes on these ports", flush=True)
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        message = (
            f"baton: serving {router.config.model_name} on {server.address} "
            f"({config.prefill.replicas} prefill + {config.decode.replicas} decode, "
            f"{config.router.disaggregation} disaggregation)"
        )
        if cluster.exporters is not None:  # before "serving": whoever waits for it has these
            for address in cluster.exporters.addresses.values():
                print(f"baton: metrics on http://{address}/metrics", flush=True)
        if http is not None:
            print(f"baton: OpenAI API on {http.scheme}://{http.address}/v1", flush=True)
        print(message, flush=True)
        if on_ready is not None:
            on_ready(server.address)
        await stop.wait()
        print("baton: draining", flush=True)
        drain = asyncio.ensure_future(_drain(server, hub, config.router.drain_grace_seconds))
        if await _head_lost_during(drain, cluster):
            await _exit_without_ray(drain, server, http)
        aborted = drain.result()
        if aborted:
            print(f"baton: aborted {aborted} requests after the grace period", flush=True)
    finally:
        if hub is not None:
            await hub.stop()
        if http is not None:
            await http.stop()
        if server is not None:
            await server.stop()
        await cluster.router.stop()
        if cluster.listener is not None:
            await cluster.listener.close()
        await _stop_ray_parts(cluster)
    print("baton: stopped", flush=True)
    return 0


async def _drain(server, hub, grace_s: float) -> int:
    """Every router process drains at once; how many requests they aborted."""
    if hub is None:
        return await server.drain(grace_s)
    counts = await asyncio.gather(server.drain(grace_s), hub.drain(grace_s))
    return sum(counts)


def _router_hub(config: ClusterConfig, cluster):
    """Processes 1..N-1 of ``router.processes`` (cluster/router_hub.py), not yet started."""
    import msgspec

    from cluster.model_source import resolve_model_dir
    from cluster.router_hub import RouterHub
    from router.process_link import Start

    listener = cluster.listener
    start = Start(
        index=0,
        config_json=config.model_dump_json(),
        router_config=msgspec.msgpack.encode(cluster.router.config),
        model_dir=str(resolve_model_dir(config.model.path)),
        workers=[],
        channel_host=listener.host,
        channel_tls=listener.cert_pem is not None,
        grpc_port=0,
        http_port=0,
    )
    return RouterHub(cluster.router, config.router.processes, start)


async def _head_lost_during(drain: asyncio.Future, cluster) -> bool:
    """Wait for the drain; True if the Ray instance we started died first (the signal
    reached its processes too: see ``Cluster.is_ray_head_gone``). Watches for at least
    ``_HEAD_WATCH_S``: the drain of an idle router ends at once, before Ray's processes
    have finished dying of the same signal."""
    watch_until = asyncio.get_running_loop().time() + _HEAD_WATCH_S
    while not drain.done() or asyncio.get_running_loop().time() < watch_until:
        if cluster.is_ray_head_gone():
            return True
        await asyncio.wait([drain], timeout=_HEAD_POLL_S)  # returns at once when done
        if drain.done():
            await asyncio.sleep(_HEAD_POLL_S)
    return False


async def _exit_without_ray(drain: asyncio.Future, server, http) -> None:
    """The workers died with Ray: nothing is left to drain or stop. Close the front ends
    (the requests in flight end with an error) and leave at once."""
    drain.cancel()
    try:
        async with asyncio.timeout(_FRONT_END_STOP_S):
            if http is not None:
                await http.stop()
            await server.stop(0)
    except BaseException:  # leaving anyway
        pass
    _leave(_HEAD_GONE)


async def _stop_ray_parts(cluster) -> None:
    """Stop the workers, then a Ray instance we started, each in a thread (they block on
    Ray) and bounded: should Ray's head die meanwhile (the signal that stopped us reached
    it too, more slowly than the drain's watch), every call would wait 60 s for it."""
    loop = asyncio.get_running_loop()
    stopping = asyncio.ensure_future(asyncio.to_thread(cluster.stop_workers))
    deadline = loop.time() + _RAY_STOP_S
    while not stopping.done():
        if cluster.is_ray_head_gone():
            _leave(_HEAD_GONE)
        if loop.time() > deadline:
            _leave(f"baton: the workers did not stop within {_RAY_STOP_S:.0f} s; exiting")
        await asyncio.wait([stopping], timeout=_HEAD_POLL_S)
    stopping.result()
    if cluster.started_ray:
        try:  # ray.shutdown() stops the head itself: no watching it now
            await asyncio.wait_for(asyncio.to_thread(ray_shutdown), _RAY_STOP_S)
        except TimeoutError:
            _leave(f"baton: Ray did not shut down within {_RAY_STOP_S:.0f} s; exiting")


def ray_shutdown() -> None:
    import ray

    ray.shutdown()


def _leave(message: str) -> None:
    """Exit now with one line: skips ray.shutdown() and atexit, which would wait for a
    dead GCS (60 s, then a traceback)."""
    print(message, flush=True)
    sys.stderr.flush()
    os._exit(0)


def api_keys(config: ClusterConfig, quiet: bool = False):
    """The API keys both front ends require (router/auth.py): ``router.api_keys_file``,
    ``router.api_key`` and the environment's; None when there are none."""
    from router.auth import ApiKeys

    keys = ApiKeys.load(config.router.api_keys_file, config.router.api_key)
    if keys is not None and not quiet:
        print(f"baton: {len(keys)} API key(s): {', '.join(keys.names)}", flush=True)
    return keys


def admin_key(config: ClusterConfig, quiet: bool = False):
    """The key the HTTP admin routes require (``baton scale``; router/http/admin.py):
    ``$BATON_ADMIN_KEY`` or ``router.admin_key_file``; None = those routes are off."""
    from router.http.admin import AdminKey

    key = AdminKey.load(config.router.admin_key_file)
    if key is not None and not quiet:
        print("baton: admin routes on (an admin key is configured)", flush=True)
    return key


def _http_server(config: ClusterConfig, router, keys, admin=None, reuse_port: bool = False):
    """The HTTP front end over ``router``, with the served model's chat template."""
    from importlib.metadata import PackageNotFoundError, version

    from cluster.model_source import resolve_model_dir
    from router.http.chat_template import ChatTemplate
    from router.http.server import HttpServer

    try:
        baton_version = version("baton")
    except PackageNotFoundError:  # run from a source tree that was never installed
        baton_version = "0.0.0"
    template = ChatTemplate.from_dir(resolve_model_dir(config.model.path))
    if template is None and not reuse_port:  # (said once, by the first process)
        print("baton: the model has no chat template: /v1/chat/completions answers 400", flush=True)
    return HttpServer(
        router,
        config.router.host,
        config.router.http_port,
        chat_template=template,
        keys=keys,
        tls=config.router.tls(),
        version=baton_version,
        admin_key=admin,
        reuse_port=reuse_port,
    )


def main(argv: list[str] | None = None) -> int:
    """``python -m cluster [CONFIG]``: the Ray job entry point."""
    from cluster.config import load_config
    from cluster.config_schema import ConfigError

    args = sys.argv[1:] if argv is None else argv
    if len(args) > 1 or (args and args[0] in ("-h", "--help")):
        print("usage: python -m cluster [CONFIG]", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        config = load_config(args[0] if args else None)
    except ConfigError as exc:
        print(f"baton: error: {exc}", file=sys.stderr)
        return 2
    try:
        return run(config)
    except (ValueError, RuntimeError) as exc:
        print(f"baton: error: {exc}", file=sys.stderr)
        return 1
