"""Peer authentication for the internal ports that leave the pod (pd-comm, kv-transfer).

Every message carries a seal as its last frame: a timestamp, a random nonce and an HMAC-SHA256
over a channel label, both of them and every frame, with the InferenceService's peer key (from a
mounted Secret). A receiver refuses a seal that does not verify, one outside the time window,
and a nonce it has seen within the window (a replay).
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import os
import pathlib
import struct
import time
from collections.abc import Iterable
from typing import Any

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
