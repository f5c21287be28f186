"""The receiving side of KV transfers: check each part of a push, store it, acknowledge once.

A push arrives as one or more parts (see ``protocol``), each checked on its own and against the
earlier parts of the same push, then written straight into the attached engine's KV segment.
Exactly one ``TransferAck`` answers a push: ok after its last part, or the error of the first
refused part. Parts that follow a refused one are dropped unanswered; a push whose parts stop
coming is forgotten after ``timeout`` seconds without an acknowledgement. The blocks a failed
push wrote into belong to that push alone (the engine reserved them for it and drops them when
the push fails), so no other request sees a partial write.

Each part is checked against its reservation and stored as one step as far as a revoke is
concerned (``Reservations.begin``/``end`` around the scatter): a part being stored while its
reservation is revoked holds back the cache manager's ``Revoked`` until it is stored, and no
part is stored after. The last part of a push uses the reservation up.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ketch.engine.cache_manager import protocol as p
from ketch.engine.cache_manager.metrics import CacheManagerMetrics
from ketch.engine.cache_manager.segment import Attachment, bad_blocks, scatter

logger = logging.getLogger("ketch.cache_manager")


@dataclass
class _Pending:
    """A push of which some parts are stored: what the next part must look like."""

    attachment: Attachment
    dest_blocks: list[int]
    parts: int
    next_part: int
    next_layer: int
    started: float
    num_bytes: int = 0


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _layers(header: p.TransferHeader, num_layers: int) -> tuple[tuple[int, int] | None, str | None]:
    """The header's ``[lo, hi)`` layer range, or why it is invalid."""
    if header.layers is None:
        return (0, num_layers), None
    rng = header.layers
    if not isinstance(rng, list | tuple) or len(rng) != 2 or not all(_is_int(x) for x in rng):
        return None, f"layers must be [lo, hi], got {rng!r}"
    lo, hi = rng
    if not 0 <= lo < hi <= num_layers:
        return None, f"layers [{lo}, {hi}) are outside [0, {num_layers})"
    return (lo, hi), None


def check_part(
    att: Attachment | None, header: p.TransferHeader, data: memoryview
) -> tuple[tuple[int, int] | None, str | None]:
    """Everything one message can be checked for alone; returns its layer range or an error."""
    if header.version != p.PROTOCOL_VERSION:
        error = f"version mismatch: peer speaks {header.version}, this cache manager "
        return None, error + str(p.PROTOCOL_VERSION)
    if att is None:
        return None, "no engine is attached to this cache manager"
    if header.engine_id and header.engine_id != att.engine_id:
        return None, (
            f"the blocks are for engine {header.engine_id}, but engine {att.engine_id} is "
            "attached here (the peer engine restarted)"
        )
    if not isinstance(header.layout, p.KVLayout):
        return None, "the header has no KV layout"
    mismatch = att.layout.mismatch(header.layout)
    if mismatch:
        return None, mismatch
    blocks = header.dest_blocks
    if not isinstance(blocks, list) or not blocks:
        return None, "dest_blocks must be a non-empty list"
    error = bad_blocks(blocks, att.layout.num_blocks, "destination block")
    if error:
        return None, error
    # A first look (an early refusal); the receiver's ``begin`` checks again with the write.
    error = att.reservations.check(header.request_id, header.nonce, blocks)
    if error:
        return None, error
    if not _is_int(header.parts) or not _is_int(header.part):
        return None, f"part {header.part!r} of {header.parts!r}: both must be integers"
    if not 0 <= header.part < header.parts <= att.layout.num_layers:
        return None, f"part {header.part} of {header.parts} is out of range"
    layers, error = _layers(header, att.layout.num_layers)
    if layers is None:
        return None, error
    expected = att.layout.block_bytes // att.layout.num_layers * (layers[1] - layers[0])
    expected *= len(blocks)
    if len(data) != expected:
        what = f"{len(blocks)} blocks of layers [{layers[0]}, {layers[1]})"
        return None, f"data frame holds {len(data)} bytes; {what} need {expected}"
    return layers, None


class TransferReceiver:
    """The cache manager's receive handler (runs on the transport's receiver thread only)."""

    def __init__(
        self,
        attachment: Callable[[], Attachment | None],
        metrics: CacheManagerMetrics,
        timeout: float,
    ) -> None:
        self._attachment = attachment
        self._metrics = metrics
        self._timeout = timeout
        self._pending: dict[tuple[bytes, str], _Pending] = {}
        self._refused: dict[tuple[bytes, str], float] = {}  # pushes answered with an error

    def __call__(
        self, peer: bytes, header: p.TransferHeader, data: memoryview
    ) -> p.TransferAck | None:
        """Stores one part; the push's TransferAck, or None while more parts are due."""
        now = time.monotonic()
        self._expire(now)
        request_id = str(header.request_id)
        key = (peer, request_id)
        if key in self._refused and header.part != 0:
            return None  # a later part of a push already answered with an error
        self._refused.pop(key, None)
        att = self._attachment()  # one snapshot per part; a re-attach fails the push
        state = self._pending.pop(key, None)
        layers, error = check_part(att, header, data)
        if layers is not None and att is not None:
            state, error = self._follow(state, att, header, layers, now)
        if error is None and state is not None and att is not None:
            # From here until ``end``, a revoke of this request is not confirmed.
            error = att.reservations.begin(request_id, header.nonce, state.dest_blocks)
        if error is not None or state is None or layers is None or att is None:
            part, parts = header.part, header.parts
            if _is_int(part) and _is_int(parts) and part + 1 < parts:  # more are coming
                self._refused[key] = now
            self._metrics.kv_transfer_failures.labels(direction="receive").inc()
            logger.warning("KV transfer %s (part %s) refused: %s", request_id, header.part, error)
            return p.TransferAck(request_id, False, error)
        lo, hi = layers
        blocks = state.dest_blocks
        shape = att.layout.transfer_shape(len(blocks), hi - lo)
        stored = False
        try:
            scatter(att.kv[lo:hi], blocks, np.frombuffer(data, dtype=att.kv.dtype).reshape(shape))
            stored = True
        finally:  # the push's last part stored: its reservation is used up
            last = stored and state.next_part + 1 == state.parts
            att.reservations.end(request_id, header.nonce if last else None)
        state.next_part, state.next_layer = state.next_part + 1, hi
        state.num_bytes += len(data)
        if state.next_part < state.parts:
            self._pending[key] = state
            return None
        self._metrics.kv_received_bytes.inc(state.num_bytes)
        self._metrics.kv_transfers.labels(direction="receive").inc()
        logger.info(
            "received %d blocks (%d bytes, %d parts) of %s",
            len(blocks), state.num_bytes, state.parts, request_id,
        )  # fmt: skip
        return p.TransferAck(request_id, True)

    def _follow(
        self,
        state: _Pending | None,
        att: Attachment,
        header: p.TransferHeader,
        layers: tuple[int, int],
        now: float,
    ) -> tuple[_Pending | None, str | None]:
        """The push's state with this part accepted as its next one, or why it cannot be."""
        lo, hi = layers
        if header.part == 0:  # a push (re)starting: an earlier incomplete one is dropped
            state = _Pending(att, list(header.dest_blocks), header.parts, 0, 0, now)
        elif state is None:
            return None, f"part {header.part} of {header.parts} came without the parts before it"
        if state.attachment is not att:
            return None, "the engine re-attached during the transfer"
        if header.parts != state.parts or header.part != state.next_part:
            return None, (
                f"part {header.part} of {header.parts} came where part {state.next_part} of "
                f"{state.parts} was due"
            )
        if header.dest_blocks != state.dest_blocks:
            return None, f"part {header.part} names other dest_blocks than part 0"
        if lo != state.next_layer:
            return None, f"part {header.part} starts at layer {lo}; layer {state.next_layer} is due"
        if header.part == header.parts - 1 and hi != att.layout.num_layers:
            return None, f"the last part ends at layer {hi} of {att.layout.num_layers}"
        return state, None

    def _expire(self, now: float) -> None:
        for key, state in list(self._pending.items()):
            if now - state.started > self._timeout:
                del self._pending[key]
                self._metrics.kv_transfer_failures.labels(direction="receive").inc()
                logger.warning(
                    "KV transfer %s: %d of %d parts came within %g s; dropped, never acknowledged",
                    key[1], state.next_part, state.parts, self._timeout,
                )  # fmt: skip
        for key, when in list(self._refused.items()):
            if now - when > self._timeout:
                del self._refused[key]
