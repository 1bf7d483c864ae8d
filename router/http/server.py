"""uvicorn serving the HTTP app in the router's own event loop (``cluster/serve.py``).

Not ``uvicorn.run`` nor ``Server.serve``: those own the loop and the process's SIGINT /
SIGTERM handlers, which ``baton serve`` keeps for its drain. The socket is bound here, so
that port 0 gives a free port whose number is known before anything is announced.
"""

from __future__ import annotations

import asyncio
import logging
import socket

import uvicorn

from router.auth import ApiKeys
from router.http.admin import AdminKey
from router.http.app import MAX_BODY_BYTES, create_app
from router.http.chat_template import ChatTemplate
from router.router import Router
from router.tls import TlsFiles

logger = logging.getLogger(__name__)


class HttpServer:
    """The OpenAI-compatible API of one router on ``host:port``."""

    def __init__(
        self,
        router: Router,
        host: str,
        port: int,
        *,
        chat_template: ChatTemplate | None = None,
        keys: ApiKeys | None = None,
        tls: TlsFiles | None = None,
        max_body_bytes: int = MAX_BODY_BYTES,
        version: str = "0.0.0",
        admin_key: AdminKey | None = None,
        reuse_port: bool = False,
    ):
        app = create_app(
            router,
            chat_template=chat_template,
            keys=keys,
            max_body_bytes=max_body_bytes,
            version=version,
            admin_key=admin_key,
        )
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        # reuse_port: the other router processes serve this port too (router.processes).
        self.socket = socket.create_server(
            (host, port), family=family, backlog=2048, reuse_port=reuse_port
        )
        self.port = self.socket.getsockname()[1]
        self.address = f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"
        config = uvicorn.Config(
            app,
            lifespan="off",
            log_level="warning",
            access_log=False,
            # The drain already waited for the requests; what is left is cut short.
            timeout_graceful_shutdown=1,
            **(tls.uvicorn_options() if tls is not None else {}),
        )
        self.scheme = "https" if tls is not None else "http"
        self.server = uvicorn.Server(config)
        self._ticks: asyncio.Task | None = None

    async def start(self) -> None:
        config = self.server.config
        config.load()
        self.server.lifespan = config.lifespan_class(config)
        await self.server.startup(sockets=[self.socket])
        # uvicorn's tick loop keeps the cached Date header current.
        self._ticks = asyncio.get_running_loop().create_task(self.server.main_loop())
        logger.info("serving the OpenAI API on %s://%s", self.scheme, self.address)

    async def stop(self) -> None:
        """Close the listener and every connection (after the router's drain)."""
        self.server.should_exit = True
        if self._ticks is not None:
            await self._ticks
        await self.server.shutdown(sockets=[self.socket])
