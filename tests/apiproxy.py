"""A TLS reverse proxy between one client under test (the operator) and kube-apiserver, which
can hold requests: stop a client at a known call without sleeping.

    proxy = HoldingProxy.for_cluster(kube.kubeconfig, workdir)   # its own CA and 127.0.0.1 cert
    kubeconfig = proxy.route(operator_kubeconfig)   # the same token, through the proxy
    proxy.hold(verb="apply", resource="deployments", namespace=ns)
    wait_for(lambda: proxy.holds()[0]["waiting"] == 1, ...)    # the client is stuck there
    proxy.release()                                 # the held requests go on; holds removed
    proxy.stop()

Each request is forwarded as it came (method, path, headers, body; the client's Authorization
header passes through, so the API server sees the client's own identity: a bearer token, as
a client certificate cannot cross a proxy that terminates TLS) on a connection of its own
with ``Connection: close``, and the answer is copied back byte for byte as it arrives (a watch
streams). A held request waits before it is forwarded; one whose client goes away meanwhile
(the operator SIGKILLed) stops waiting and is never forwarded, as a request that never reached
the server. Verbs are the API server's (get, list, watch, create, update, patch, delete,
deletecollection) plus ``apply`` for a server-side apply patch; a resource's subresource is
``deployments/status``.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import ssl
import threading
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

import kubecluster  # noqa: F401  (puts hack/ on sys.path)
from localcluster import pki

HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "upgrade"}
HOP_BY_HOP |= {"host", "content-length", "te", "trailer", "expect"}


@dataclass
class Hold:
    verb: str | None = None
    resource: str | None = None
    namespace: str | None = None
    name: str | None = None
    caught: int = 0  # requests it stopped
    waiting: int = 0  # stopped now
    released: asyncio.Event = field(default_factory=asyncio.Event)

    def matches(self, request: tuple[str | None, ...]) -> bool:
        wanted = (self.verb, self.resource, self.namespace, self.name)
        return all(w is None or w == a for w, a in zip(wanted, request, strict=True))


def describe(method: str, target: str, content_type: str) -> tuple[str | None, ...]:
    """(verb, resource, namespace, name) of an API request; resource None for /version etc."""
    path, _, query = target.partition("?")
    parts = [urllib.parse.unquote(p) for p in path.split("/") if p]
    if parts[:1] == ["api"]:
        rest = parts[2:]
    elif parts[:1] == ["apis"]:
        rest = parts[3:]
    else:
        rest = []
    if not rest:
        return (None, None, None, None)
    namespace = None
    if rest[0] == "namespaces" and len(rest) >= 3:
        namespace, rest = rest[1], rest[2:]
    resource = "/".join([rest[0], *rest[2:3]])
    name = rest[1] if len(rest) > 1 else None
    watch = urllib.parse.parse_qs(query).get("watch", [""])[0] in ("true", "1")
    verb = {
        "GET": "watch" if watch else ("get" if name else "list"),
        "POST": "create",
        "PUT": "update",
        "PATCH": "apply" if content_type.startswith("application/apply-patch") else "patch",
        "DELETE": "delete" if name else "deletecollection",
    }.get(method, method.lower())
    return (verb, resource, namespace, name)


class HoldingProxy:
    """Serves https://127.0.0.1:<port> from a thread of its own; forwards to ``server``."""

    def __init__(self, server: str, server_ca: str, workdir: Path):
        upstream = urllib.parse.urlsplit(server)
        self.upstream_host, self.upstream_port = upstream.hostname, upstream.port or 443
        self._upstream_tls = ssl.create_default_context(cadata=server_ca)
        workdir.mkdir(parents=True, exist_ok=True)
        pki.make_ca(workdir, "proxy-ca", "ketch-test-proxy-ca")
        pki.make_cert(workdir, "proxy", "proxy-ca", "ketch-test-proxy", server_names=("127.0.0.1",))
        self.ca = (workdir / "proxy-ca.crt").read_text()
        self._tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self._tls.load_cert_chain(workdir / "proxy.crt", workdir / "proxy.key")
        self._tls.set_alpn_protocols(["http/1.1"])
        self._holds: list[Hold] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._server = self._call(self._listen())
        self.url = f"https://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    @classmethod
    def for_cluster(cls, kubeconfig: str | Path, workdir: Path) -> HoldingProxy:
        """A proxy to the server ``kubeconfig`` names, trusting its CA."""
        cluster, _ = _current(Path(kubeconfig))
        if "certificate-authority-data" in cluster:
            ca = base64.b64decode(cluster["certificate-authority-data"]).decode()
        else:
            ca = (Path(kubeconfig).parent / cluster["certificate-authority"]).read_text()
        return cls(cluster["server"], ca, workdir)

    def route(self, kubeconfig: str | Path) -> Path:
        """A copy of ``kubeconfig`` (beside it, ``.proxied``) that goes through the proxy; its user
        must sign in with a token, which the proxy passes on."""
        path = Path(kubeconfig)
        doc = yaml.safe_load(path.read_text())
        cluster, user = _current(path, doc)
        if any(k.startswith("client-certificate") for k in user):
            raise ValueError("a client certificate cannot pass through the proxy: use a token")
        for key in ("certificate-authority", "insecure-skip-tls-verify"):
            cluster.pop(key, None)
        cluster["server"] = self.url
        cluster["certificate-authority-data"] = base64.b64encode(self.ca.encode()).decode()
        out = path.with_name(path.name + ".proxied")
        out.write_text(yaml.safe_dump(doc))
        return out

    # ---- holds (called from the test's thread)
    def hold(self, **match: str) -> None:
        """Every later request matching all of ``match`` (verb, resource, namespace, name)
        waits until ``release()``."""
        unknown = set(match) - {"verb", "resource", "namespace", "name"}
        assert not unknown, f"unknown hold fields: {unknown}"

        async def add() -> None:
            self._holds.append(Hold(**match))

        self._call(add())

    def holds(self) -> list[dict[str, Any]]:
        """Each hold: its match, ``caught`` and ``waiting`` (requests waiting now)."""

        async def read() -> list[dict[str, Any]]:
            keys = ("verb", "resource", "namespace", "name", "caught", "waiting")
            return [{k: getattr(h, k) for k in keys} for h in self._holds]

        return self._call(read())

    def release(self) -> None:
        """Lets every waiting request through and removes the holds."""

        async def release() -> None:
            for hold in self._holds:
                hold.released.set()
            self._holds.clear()

        self._call(release())

    def stop(self) -> None:
        """Closes the listener and every connection (open watches end), then the thread."""

        async def close() -> None:
            self._server.close()
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

        self._call(close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    def __enter__(self) -> HoldingProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- the proxy (on its own event loop)
    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=30)

    async def _listen(self) -> asyncio.Server:
        def connected(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            task = asyncio.ensure_future(self._serve(reader, writer))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

        return await asyncio.start_server(connected, "127.0.0.1", 0, ssl=self._tls, limit=1 << 20)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One request per connection: read it, hold it if asked, forward it, copy the answer."""
        try:
            head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
            request_line, *lines = head.split("\r\n")[:-2]
            method, target, _ = request_line.split(" ", 2)
            headers = [tuple(s.strip() for s in line.split(":", 1)) for line in lines]
            fields = {k.lower(): v for k, v in headers}
            if fields.get("expect", "").lower() == "100-continue":
                writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            body = await _read_body(reader, fields)
            hold = next(
                (
                    h
                    for h in self._holds
                    if h.matches(describe(method, target, fields.get("content-type", "")))
                ),
                None,
            )
            if hold is not None and not await self._held(hold, reader):
                return  # the client went away: never forwarded
            await self._forward(method, target, headers, body, reader, writer)
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError):
            pass  # a client or the API server hung up, or spoke no HTTP/1.1
        finally:
            writer.close()

    async def _held(self, hold: Hold, client: asyncio.StreamReader) -> bool:
        """Waits for the release (True) or for the client to hang up (False)."""
        hold.caught += 1
        hold.waiting += 1
        released = asyncio.ensure_future(hold.released.wait())
        gone = asyncio.ensure_future(client.read(1))  # a client sends nothing until answered
        try:
            await asyncio.wait({released, gone}, return_when=asyncio.FIRST_COMPLETED)
            return not gone.done()
        finally:
            hold.waiting -= 1
            released.cancel()
            gone.cancel()

    async def _forward(
        self,
        method: str,
        target: str,
        headers: list[tuple[str, ...]],
        body: bytes,
        client: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        up_reader, up_writer = await asyncio.open_connection(
            self.upstream_host, self.upstream_port, ssl=self._upstream_tls, limit=1 << 20
        )
        try:
            out = [f"{method} {target} HTTP/1.1", f"Host: {self.upstream_host}"]
            out += [f"{k}: {v}" for k, v in headers if k.lower() not in HOP_BY_HOP]
            if body or method in ("POST", "PUT", "PATCH"):
                out.append(f"Content-Length: {len(body)}")
            out.append("Connection: close")
            up_writer.write(("\r\n".join(out) + "\r\n\r\n").encode("latin-1") + body)
            await up_writer.drain()
            # The answer (its headers say Connection: close) until the API server closes it,
            # or until the client hangs up (a watch it no longer wants).
            copy = asyncio.ensure_future(_copy(up_reader, writer))
            gone = asyncio.ensure_future(client.read(1))
            try:
                await asyncio.wait({copy, gone}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                copy.cancel()
                gone.cancel()
        finally:
            up_writer.close()


async def _read_body(reader: asyncio.StreamReader, fields: dict[str, str]) -> bytes:
    if "chunked" in fields.get("transfer-encoding", "").lower():
        body = b""
        while size := int((await reader.readuntil(b"\r\n")).split(b";")[0], 16):
            body += await reader.readexactly(size)
            await reader.readexactly(2)
        while await reader.readuntil(b"\r\n") != b"\r\n":  # trailers
            pass
        return body
    return await reader.readexactly(int(fields.get("content-length", "0")))


async def _copy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(OSError, ssl.SSLError):
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()


def _current(path: Path, doc: dict[str, Any] | None = None) -> tuple[dict[str, Any], dict]:
    """The current context's cluster and user entries of a kubeconfig (``doc``, or read)."""
    doc = doc if doc is not None else yaml.safe_load(path.read_text())
    context_name = doc.get("current-context") or doc["contexts"][0]["name"]

    def named(section: str, name: str) -> dict[str, Any]:
        return next(e for e in doc[section] if e["name"] == name)

    context = named("contexts", context_name)["context"]
    return named("clusters", context["cluster"])["cluster"], named("users", context["user"])["user"]
