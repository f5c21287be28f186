"""ClusterIP Services as local TCP proxies, the way kube-proxy spreads connections.

Each Service port listens on a free loopback port; every new connection goes to the next ready
endpoint (round robin over the pods the Service selects that are ready now) and is piped both
ways until either side closes. With no ready endpoint the connection is closed at once, like a
Service without endpoints. Connections already open stay where they are when a pod stops being
ready, so a pod that drains finishes what it has.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import socket
import threading
from collections.abc import Callable

Endpoints = Callable[[], list[int]]
"""Returns the local ports of the ready endpoints, now."""


class ServiceProxies:
    """All the Service proxies of one cluster, served by one event loop thread."""

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._servers: list[asyncio.base_events.Server] = []
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()

    def add(self, endpoints: Endpoints) -> int:
        """Starts a proxy over ``endpoints``; returns its port."""
        counter = itertools.count()

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            ports = endpoints()
            if not ports:
                writer.close()
                return
            port = ports[next(counter) % len(ports)]
            try:
                up_reader, up_writer = await asyncio.open_connection("127.0.0.1", port)
            except OSError:
                writer.close()
                return
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        server = asyncio.start_server(handle, sock=sock)
        future = asyncio.run_coroutine_threadsafe(server, self._loop)
        self._servers.append(future.result(10))
        return sock.getsockname()[1]

    def close(self) -> None:
        async def stop() -> None:
            for server in self._servers:
                server.close()

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(stop(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.close()
