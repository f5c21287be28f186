"""Peer authentication for the internal ports that leave the pod (pd-comm, kv-transfer).

Two layers, both keyed by the InferenceService's peer key (from a mounted Secret):

- **The connection** (``gate_server``/``gate_client``): a receiving socket takes a connection only
  after the peer proved it holds the key, before it may send a single message. ZMQ's PLAIN
  handshake carries a token derived from the key (an HMAC of the channel's name, never the key
  itself) and a ZAP handler of this process compares it in constant time. Until then libzmq
  buffers one handshake frame of at most the socket's ``MAXMSGSIZE``, for at most
  ``HANDSHAKE_S`` seconds; an unauthenticated peer cannot make it buffer messages (a message
  whose frames never end stays in libzmq's pipe otherwise, whatever HWM says).
- **Every message** carries a seal as its last frame: a timestamp, a random nonce and an
  HMAC-SHA256 over a channel label, both of them and every frame. A receiver refuses a seal that
  does not verify, one outside the time window, and a nonce it has seen within the window (a
  replay).

Without a key (``--insecure-no-peer-key``, trusted networks only) neither applies; the prefill and
decode roles and the cache manager refuse to start without a key unless told so
(``require_peer_key``).
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import itertools
import logging
import os
import pathlib
import struct
import threading
import time
from collections.abc import Iterable
from typing import Any

import zmq

logger = logging.getLogger("ketch.peer_auth")

PEER_KEY_ENV = "KETCH_PEER_KEY"
PEER_AUTH_WINDOW_S = 30.0
"""How far a sealed message's timestamp may be from the receiver's clock (either way)."""
_STAMP = struct.Struct(">Q16s")  # timestamp (ns since the epoch), random nonce
SEAL_BYTES = _STAMP.size + 32  # + HMAC-SHA256


def read_peer_key(file: str | None, flag: str = "--peer-key-file") -> bytes | None:
    """The peer key from ``file`` (surrounding whitespace stripped), else from $KETCH_PEER_KEY;
    None: no key (trusted network only). ValueError for a missing, empty or short file."""
    if file:
        path = pathlib.Path(file)
        if not path.is_file():
            raise ValueError(f"{flag} {path} does not exist")
        key = path.read_bytes().strip()
        source = f"{flag} {path}"
    else:
        key = os.environ.get(PEER_KEY_ENV, "").strip().encode()
        source = f"${PEER_KEY_ENV}"
        if not key:
            return None
    if len(key) < 16:
        raise ValueError(f"{source} holds {len(key)} bytes; a peer key needs at least 16")
    return key


INSECURE_FLAG = "--insecure-no-peer-key"


def require_peer_key(file: str | None, insecure: bool, what: str) -> bytes | None:
    """The peer key (see ``read_peer_key``); without one a ValueError unless ``insecure``
    (``--insecure-no-peer-key``): ``what`` (e.g. "the prefill role") would otherwise take
    pd-comm or KV transfers from anyone who reaches its port."""
    key = read_peer_key(file)
    if key is None and not insecure:
        raise ValueError(
            f"{what} needs a peer key: --peer-key-file FILE or ${PEER_KEY_ENV} (the operator "
            f"mounts spec.auth.peerKeySecretRef); without one its internal ports would take "
            f"messages from anyone who reaches them. {INSECURE_FLAG} runs without (trusted "
            "networks only)"
        )
    return key


# ----------------------------------------------------------------- connection-level gate

HANDSHAKE_S = 5.0
"""A connection that has not authenticated within this many seconds is dropped."""
ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # where libzmq asks a context's ZAP handler (RFC 27)
_USERNAME = b"ketch"


def connection_token(key: bytes, channel: bytes) -> bytes:
    """What a peer presents when it connects to ``channel``: an HMAC of the channel's name (the
    key itself never travels; a token seen on the wire opens a connection to that channel only,
    and every message still needs its seal)."""
    return hmac.new(key, b"ketch connection v1 " + channel, hashlib.sha256).hexdigest().encode()


class _ZapHandler:
    """The ZAP handler of one ZMQ context: answers libzmq's questions about connecting peers on
    its own thread; ``tokens`` maps each gated socket's ZAP domain to the token it accepts."""

    def __init__(self, context: zmq.Context) -> None:
        self.tokens: dict[bytes, bytes] = {}
        self.accepted = 0
        self.refused = 0
        self._sock = context.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(ZAP_ENDPOINT)  # before any gated socket binds: no unchecked window
        self._context = context
        threading.Thread(target=self._run, name="ketch-zap", daemon=True).start()

    def _run(self) -> None:
        sock = self._sock
        try:
            while True:
                request = sock.recv_multipart()
                sock.send_multipart(self.answer(request))
        except zmq.ContextTerminated:
            pass
        finally:
            sock.close(linger=0)
            with _HANDLERS_LOCK:
                if _HANDLERS.get(id(self._context)) is self:
                    del _HANDLERS[id(self._context)]

    def answer(self, request: list[bytes]) -> list[bytes]:
        """The ZAP reply to one request: 200 for the right token on the right domain."""
        request_id = request[1] if len(request) > 1 else b""
        ok = False
        if len(request) == 8 and request[5] == b"PLAIN":
            domain, username, password = request[2], request[6], request[7]
            token = self.tokens.get(domain)
            ok = (
                token is not None and username == _USERNAME and hmac.compare_digest(password, token)
            )
        if ok:
            self.accepted += 1
            return [b"1.0", request_id, b"200", b"OK", b"peer", b""]
        self.refused += 1
        return [b"1.0", request_id, b"400", b"no valid peer-key token", b"", b""]


_HANDLERS: dict[int, _ZapHandler] = {}  # id(context) -> its handler (which keeps it alive)
_HANDLERS_LOCK = threading.Lock()
_DOMAINS = itertools.count()


def zap_handler(context: zmq.Context) -> _ZapHandler:
    """The context's ZAP handler, started on first use."""
    with _HANDLERS_LOCK:
        handler = _HANDLERS.get(id(context))
        if handler is None:
            handler = _HANDLERS[id(context)] = _ZapHandler(context)
        return handler


def gate_server(sock: zmq.Socket, key: bytes | None, channel: bytes) -> bytes | None:
    """Before ``sock`` binds: with a key, a connecting peer must present ``connection_token``
    within ``HANDSHAKE_S`` seconds or is dropped before it can send a message. Returns the ZAP
    domain to pass to ``ungate`` when the socket closes (None without a key)."""
    if key is None:
        return None
    handler = zap_handler(sock.context)
    domain = f"ketch-{channel.decode(errors='replace')}-{next(_DOMAINS)}".encode()
    handler.tokens[domain] = connection_token(key, channel)
    sock.setsockopt(zmq.ZAP_DOMAIN, domain)
    sock.setsockopt(zmq.PLAIN_SERVER, 1)
    sock.setsockopt(zmq.HANDSHAKE_IVL, int(HANDSHAKE_S * 1000))
    return domain


def gate_client(sock: zmq.Socket, key: bytes | None, channel: bytes) -> None:
    """Before ``sock`` connects: present the token a ``gate_server`` socket of ``channel``
    asks for (nothing without a key)."""
    if key is None:
        return
    sock.setsockopt(zmq.PLAIN_USERNAME, _USERNAME)
    sock.setsockopt(zmq.PLAIN_PASSWORD, connection_token(key, channel))


def ungate(context: zmq.Context, domain: bytes | None) -> None:
    """Forgets a closed socket's ZAP domain."""
    if domain is None:
        return
    with _HANDLERS_LOCK:
        handler = _HANDLERS.get(id(context))
    if handler is not None:
        handler.tokens.pop(domain, None)


class PeerAuth:
    """HMAC-SHA256 seals for the messages on ports that leave the pod (pd-comm, kv-transfer).

    ``seal`` returns one extra frame (timestamp, random nonce, MAC over a channel label and
    every frame, length-prefixed) sent after a message's frames; ``check`` verifies it in
    constant time, refuses a timestamp more than ``window`` seconds from this clock, and a nonce
    it has seen within the window (a replay). The channel label binds a seal to one direction of
    one protocol, so a captured answer cannot be sent back as a request. One instance per thread.
    """

    MAX_SEEN = 1 << 20  # nonces remembered per window; only a key holder can fill it

    def __init__(
        self, key: bytes, window: float = PEER_AUTH_WINDOW_S, clock: Any = time.time
    ) -> None:
        self._key = key
        self._window_ns = int(window * 1e9)
        self._clock = clock
        self._seen: set[bytes] = set()
        self._expiry: collections.deque[tuple[int, bytes]] = collections.deque()

    def _mac(self, channel: bytes, stamp: bytes, frames: Iterable[Any]) -> bytes:
        mac = hmac.new(self._key, channel, hashlib.sha256)
        mac.update(stamp)
        for frame in frames:
            view = memoryview(frame)
            mac.update(view.nbytes.to_bytes(8, "big"))
            mac.update(view)
        return mac.digest()

    def seal(self, channel: bytes, *frames: Any) -> bytes:
        stamp = _STAMP.pack(int(self._clock() * 1e9), os.urandom(16))
        return stamp + self._mac(channel, stamp, frames)

    def check(self, channel: bytes, frames: Iterable[Any], seal: Any) -> str | None:
        """None if ``seal`` is a fresh, valid seal of ``frames``; else why it is refused."""
        seal = bytes(seal)
        if len(seal) != SEAL_BYTES:
            return f"no valid peer-key seal ({len(seal)} bytes instead of {SEAL_BYTES})"
        stamp, mac = seal[: _STAMP.size], seal[_STAMP.size :]
        when, nonce = _STAMP.unpack(stamp)
        if not hmac.compare_digest(mac, self._mac(channel, stamp, frames)):
            return "bad peer-key MAC (a peer without this InferenceService's key?)"
        now = int(self._clock() * 1e9)
        if abs(now - when) > self._window_ns:
            return f"sealed {(now - when) / 1e9:.1f} s from now, outside the replay window"
        while self._expiry and self._expiry[0][0] < now:
            self._seen.discard(self._expiry.popleft()[1])
        if nonce in self._seen:
            return "a replayed message (its nonce was seen within the window)"
        if len(self._seen) >= self.MAX_SEEN:
            return "too many messages within the replay window"
        self._seen.add(nonce)
        self._expiry.append((now + 2 * self._window_ns, nonce))
        return None
