"""Wire formats of the cache manager: engine <-> cache manager, and cache manager <-> cache manager.

Engine <-> its cache manager (the *cache queue*): the cache manager binds a ZMQ ROUTER on
``tcp://127.0.0.1:<cache_queue_port>``; the engine process connects a DEALER (``ZMQ_IMMEDIATE``,
so it sends nothing while no cache manager listens). Every message is one frame: a tagged JSON
object (``encode``/``decode``). The engine says ``Hello`` (repeating it until answered) with the
layout of its KV cache; the cache manager maps the shared-memory segment named in the layout and
answers ``HelloAck``. After that:

- ``Ping`` -> ``Pong``: liveness, every second. The engine detaches after 3 s without a word
  from the cache manager; the cache manager after 5 s without one from the engine.
- ``Swap`` -> ``SwapDone``: copy device blocks out to host swap slots, then swap slots into device
  blocks (outs strictly before ins: an evicted block may be reused by an in of the same message).
  The engine blocks on the answer; the copies are plain memory copies.
- ``Push`` -> ``PushDone``: send device blocks to a peer's cache manager (prefill -> decode KV
  transfer). Asynchronous: the engine keeps the blocks referenced until ``PushDone`` arrives.
  A push that cannot be taken (too many queued for its destination, the destination's circuit
  open, its deadline ``expires_at`` passed) gets its ``PushDone`` at once (``push.Pusher``).
- ``Reserve`` -> ``Reserved`` (decode role): a peer may write these blocks for this request.
- ``Revoke`` -> ``Revoked``: the reservations end. A barrier: ``Revoked`` comes once no part of
  a push is being stored into them any more, and none is stored after, so the engine frees the
  blocks only then (``reservations.py``). Idempotent: the engine repeats it until answered.
  A ``Hello`` (a new engine, or one that re-attaches after being silent) drops every
  reservation.

Cache manager -> cache manager (KV transfer, ``--kv-transfer-port``, bound on all interfaces): the
sender connects a DEALER to ``tcp://<host>:<kv_transfer_port>`` and sends the push as ``parts``
messages (``part`` 0, 1, ...), each of two frames: a ``TransferHeader`` (JSON) and the block data
of the layers ``[lo, hi)`` named by ``layers``: the sender's ``kv[lo:hi, :, :, blocks]`` gathered
into one C-contiguous array of shape ``layout.transfer_shape(len(blocks), hi - lo)``, i.e.
``[hi - lo, 2, kv_heads, n, block_size, head_dim]``, block ``i`` going to ``dest_blocks[i]``. The
parts cover the layers in order without gaps, so the sender gathers part k+1 while part k is on
the wire and the receiver stores part k while part k+1 arrives (pipelining). A header without
``layers`` is the one-part transfer of every layer (``parts`` 1: the original format).

The receiver checks every part on its own (version, engine id, layout, block range, layer range,
frame size) and against the earlier parts of the same push (same blocks, next part, next
layers), writes it into its engine's KV segment (``kv[lo:hi, :, :, dest_blocks] = data``) and
answers exactly one ``TransferAck`` per push: ok after the last part is stored, or an error as
soon as a part is refused (the push's later parts are then dropped unanswered). A push whose
parts stop coming is forgotten after the transfer timeout, never acknowledged.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ketch.engine import wire

PROTOCOL_VERSION = 4
"""Bumped whenever a message or the KV layout changes; peers with another version are refused."""
MAX_CONTROL_BYTES = 16 << 20
"""A control message or transfer header (block lists of a long prompt fit; KV data travels in
frames of its own)."""

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class KVLayout:
    """How one engine's KV cache is laid out in its shared-memory segment.

    The segment holds ``[num_layers, 2, kv_heads, num_blocks, block_size, head_dim]`` (K and V),
    the ``KVCache`` layout of the worker. Two instances can exchange blocks when everything but
    ``num_blocks`` and ``segment`` agrees.
    """

    num_layers: int
    kv_heads: int
    num_blocks: int
    block_size: int
    head_dim: int
    dtype: str = "float32"
    segment: str = ""  # the shared-memory name (``/dev/shm/<segment>``)

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.kv_heads, self.num_blocks, self.block_size, self.head_dim)

    @property
    def block_shape(self) -> tuple[int, ...]:
        """One block's data as sent over the wire and kept in a swap slot."""
        return (self.num_layers, 2, self.kv_heads, self.block_size, self.head_dim)

    def transfer_shape(self, num_blocks: int, num_layers: int | None = None) -> tuple[int, ...]:
        """The wire shape of ``num_blocks`` blocks of ``num_layers`` (default all) layers."""
        return (
            self.num_layers if num_layers is None else num_layers,
            2,
            self.kv_heads,
            num_blocks,
            self.block_size,
            self.head_dim,
        )

    @property
    def block_bytes(self) -> int:
        n = self.num_layers * 2 * self.kv_heads * self.block_size * self.head_dim
        return n * _DTYPE_BYTES[self.dtype]

    def mismatch(self, other: KVLayout, other_name: str = "the sender") -> str | None:
        """Why blocks of ``other`` cannot go into this cache (or back), or None if they can."""
        for name in ("num_layers", "kv_heads", "block_size", "head_dim", "dtype"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                return f"KV layouts differ: {name} is {theirs} on {other_name}, {mine} here"
        return None


# ---- engine -> cache manager ----


@dataclass
class Hello:
    engine_id: str  # random per engine process start: a new id means a new KV segment
    version: int
    layout: KVLayout


@dataclass
class Ping:
    engine_id: str


@dataclass
class Swap:
    seq: int
    out: list[tuple[int, int]] = field(default_factory=list)  # (device block, swap slot)
    into: list[tuple[int, int]] = field(default_factory=list)  # (swap slot, device block)


@dataclass
class Push:
    request_id: str
    blocks: list[int]  # device blocks here, in order
    dest: str  # "host:port" of the peer cache manager's KV transfer endpoint
    dest_blocks: list[int]  # where they go in the peer's cache, same order
    # The peer engine those blocks belong to (its Hello engine_id); the peer cache manager
    # refuses the transfer if it is attached to another engine (it restarted meanwhile).
    dest_engine_id: str = ""
    # The nonce of the peer's reservation of dest_blocks for this request (see Reserve).
    dest_nonce: str = ""
    # Wall clock (the request's PrefillRequest.expires_at): not started, or abandoned, after it.
    expires_at: float = 0.0


@dataclass
class Reserve:
    """Decode side: a peer may write ``blocks`` for ``request_id`` if it shows ``nonce``, for
    ``ttl`` seconds (``reservations.py``). Answered with ``Reserved``: only then does the decode
    engine tell the prefill peer, so no push can beat its reservation."""

    request_id: str
    blocks: list[int]
    nonce: str
    ttl: float

    def __post_init__(self) -> None:
        if not 0 < self.ttl <= 86_400:
            raise ValueError(f"ttl must be in (0, 86400] seconds, got {self.ttl}")
        if len(self.nonce) < 16:
            raise ValueError("the nonce must have at least 16 characters")


@dataclass
class Reserved:
    """Cache manager -> decode engine: the reservation is in place (or why not)."""

    request_id: str
    ok: bool
    error: str | None = None


@dataclass
class Revoke:
    """Decode side: the reservations of these requests end now (before their blocks are freed).
    Answered with ``Revoked`` once nothing more can land in their blocks."""

    request_ids: list[str]


@dataclass
class Revoked:
    """Cache manager -> decode engine: nothing is being stored, nor will be, into the blocks of
    these requests' reservations (ended, or never there): their blocks may go to others."""

    request_ids: list[str]


# ---- cache manager -> engine ----


@dataclass
class HelloAck:
    cache_manager_id: str  # random per cache-manager start: a new id means the swap was lost
    version: int
    swap_slots: int  # host swap capacity in blocks (0: no swap space)
    error: str | None = None  # set when the cache manager refuses (version, layout, segment)


@dataclass
class Pong:
    cache_manager_id: str


@dataclass
class SwapDone:
    seq: int
    ok: bool
    error: str | None = None


@dataclass
class PushDone:
    request_id: str
    ok: bool
    num_bytes: int = 0
    seconds: float = 0.0
    error: str | None = None


# ---- cache manager -> cache manager ----


@dataclass
class TransferHeader:
    version: int
    request_id: str
    layout: KVLayout  # the sender's (its num_blocks/segment are irrelevant to the receiver)
    dest_blocks: list[int]
    engine_id: str = ""  # Push.dest_engine_id: refused unless it is the attached engine's id
    nonce: str = ""  # Push.dest_nonce: refused unless the blocks are reserved under it
    # Multi-part pushes: the layers [lo, hi) this message's data holds (None: all of them), and
    # which part of how many it is. Parts come in order and cover the layers in order.
    layers: list[int] | None = None
    part: int = 0
    parts: int = 1


@dataclass
class TransferAck:
    request_id: str
    ok: bool
    error: str | None = None


Message = (
    Hello
    | Ping
    | Swap
    | Push
    | Reserve
    | Reserved
    | Revoke
    | Revoked
    | HelloAck
    | Pong
    | SwapDone
    | PushDone
    | TransferHeader
    | TransferAck
)
_TYPES = wire.registry(
    Hello, Ping, Swap, Push, Reserve, Reserved, Revoke, Revoked, HelloAck, Pong, SwapDone,
    PushDone, TransferHeader, TransferAck,
)  # fmt: skip


def encode(message: Message) -> bytes:
    return wire.encode(message)


def decode(data: bytes) -> Message:
    """Parses one message; raises wire.MessageError on anything malformed (never trusts the
    peer)."""
    return wire.decode(data, _TYPES, "cache-manager", max_bytes=MAX_CONTROL_BYTES)
