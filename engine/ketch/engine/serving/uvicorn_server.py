"""Uvicorn servers that drain on our terms: shared by ``ketch serve`` and ``ketch router``.

uvicorn's own signal handlers would stop accepting and cut streams at once; our processes instead
turn /ready to 503 first and let requests in flight finish. So servers are made without signal
handlers, and SIGTERM/SIGINT only set an event the process's main coroutine waits on.
"""

from __future__ import annotations

import asyncio
import signal

import uvicorn


def make_server(app, host: str, port: int, drain_timeout: float | None = None) -> uvicorn.Server:
    """A server for ``app`` that leaves SIGTERM/SIGINT to ``stop_event``; when it is told to
    exit it gives open connections up to ``drain_timeout`` seconds."""
    extra = {}
    if drain_timeout is not None:
        extra["timeout_graceful_shutdown"] = max(1, int(drain_timeout))
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", **extra))
    server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
    return server


def stop_event() -> asyncio.Event:
    """An event set by SIGTERM or SIGINT (call from the running event loop)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop
