"""A small Envoy ``ext_proc`` client for tests: plays the gateway's side of the GAIE endpoint
picker protocol on Envoy's own generated protos (``xds-protos``).

- ``pick(target, body, headers)`` streams one HTTP request's phases to an endpoint picker as
  Envoy would, in buffered body mode (headers, wait for their answer, then the whole body) or,
  with ``streamed=True``, in FULL_DUPLEX_STREAMED mode (headers and body chunks without waiting),
  and returns a ``Pick``: the destination list, the ``envoy.lb`` dynamic metadata value, the
  headers the picker set or removed, and the ImmediateResponse status when it answered itself.
- ``apick(aio_channel, body, ...)``: the same on a ``grpc.aio`` channel.
- ``exchange(target, messages)`` sends raw ``ProcessingRequest`` messages (for hostile tests).
- ``health(target, service)`` asks ``grpc.health.v1.Health/Check``.

``target`` is a ``host:port`` string (a channel is opened and closed per call) or an open
``grpc.Channel`` (reused: benchmarks). The API is kept stable for other tests.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as mode_pb
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf import json_format, struct_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

DESTINATION = "x-gateway-destination-endpoint"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
METADATA_NAMESPACE = "envoy.lb"
_END = object()


@dataclass
class Pick:
    """What the picker answered for one request's request phases."""

    destinations: list[str] = field(default_factory=list)  # the header's list, primary first
    header: str | None = None  # x-gateway-destination-endpoint as set
    metadata: str | None = None  # dynamic_metadata["envoy.lb"]["x-gateway-destination-endpoint"]
    headers: dict[str, str] = field(default_factory=dict)  # every header set (lower-cased)
    removed: list[str] = field(default_factory=list)  # headers the picker removes
    status: int | None = None  # ImmediateResponse HTTP status, when it answered itself
    immediate_body: bytes = b""
    echoed: bytes = b""  # streamed mode: the body the picker sent back
    responses: list[pb.ProcessingResponse] = field(default_factory=list)

    @property
    def primary(self) -> str | None:
        return self.destinations[0] if self.destinations else None


def _channel(target: str | grpc.Channel) -> tuple[grpc.Channel, bool]:
    if isinstance(target, str):
        return grpc.insecure_channel(target), True
    return target, False


def header_map(headers: dict[str, str]) -> base_pb2.HeaderMap:
    return base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in headers.items()]
    )


def request_headers(
    headers: dict[str, str],
    end_of_stream: bool,
    subset: Sequence[str] | None = None,
    streamed: bool = False,
) -> pb.ProcessingRequest:
    """The first message of a stream, as Envoy sends it (with its protocol configuration)."""
    mode = mode_pb.ProcessingMode
    body_mode = mode.FULL_DUPLEX_STREAMED if streamed else mode.BUFFERED
    message = pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(headers=header_map(headers), end_of_stream=end_of_stream),
        protocol_config=pb.ProtocolConfiguration(
            request_body_mode=body_mode, response_body_mode=body_mode
        ),
    )
    if subset is not None:
        hint = struct_pb2.Struct()
        hint.update({SUBSET_KEY: list(subset)})
        message.metadata_context.filter_metadata[SUBSET_NAMESPACE].CopyFrom(hint)
    return message


def body_message(data: bytes, end_of_stream: bool) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=data, end_of_stream=end_of_stream))


class _Stream:
    """One Process stream whose requests are pushed while its answers are read."""

    def __init__(self, channel: grpc.Channel, timeout: float) -> None:
        self._queue: queue.Queue = queue.Queue()
        stub = pb_grpc.ExternalProcessorStub(channel)
        self.call = stub.Process(self._requests(), timeout=timeout)

    def _requests(self) -> Iterator[pb.ProcessingRequest]:
        while (item := self._queue.get()) is not _END:
            yield item

    def send(self, message: pb.ProcessingRequest) -> None:
        self._queue.put(message)

    def receive(self) -> pb.ProcessingResponse | None:
        return next(self.call, None)

    def close(self) -> None:
        self._queue.put(_END)
        self.call.cancel()


def _read_pick(pick: Pick, response: pb.ProcessingResponse) -> None:
    pick.responses.append(response)
    kind = response.WhichOneof("response")
    if kind == "immediate_response":
        pick.status = response.immediate_response.status.code
        pick.immediate_body = response.immediate_response.body
        return
    if kind is None or kind.endswith("trailers"):
        return  # trailers answers carry no pick
    common = getattr(response, kind).response
    for option in common.header_mutation.set_headers:
        value = option.header.raw_value.decode() or option.header.value
        pick.headers[option.header.key.lower()] = value
    pick.removed += [h.lower() for h in common.header_mutation.remove_headers]
    if common.body_mutation.HasField("streamed_response"):
        pick.echoed += common.body_mutation.streamed_response.body
    lb = json_format.MessageToDict(response.dynamic_metadata).get(METADATA_NAMESPACE, {})
    if DESTINATION in lb:
        pick.metadata = lb[DESTINATION]
    if DESTINATION in pick.headers:
        pick.header = pick.headers[DESTINATION]
        pick.destinations = pick.header.split(",")


def _done(response: pb.ProcessingResponse, streamed: bool, with_body: bool) -> bool:
    kind = response.WhichOneof("response")
    if kind == "immediate_response" or not with_body:
        return True
    if kind != "request_body":
        return False
    if not streamed:
        return True
    return response.request_body.response.body_mutation.streamed_response.end_of_stream


def pick(
    target: str | grpc.Channel,
    body: bytes,
    headers: dict[str, str] | None = None,
    subset: Sequence[str] | None = None,
    streamed: bool = False,
    chunk: int = 16384,
    path: str = "/v1/completions",
    timeout: float = 10.0,
) -> Pick:
    """Streams one request's phases to the picker and returns what it decided.

    ``headers``: extra request headers (``:method``, ``:path`` and ``content-type`` are added).
    ``subset``: the subset hint (endpoints ``ip:port``) in the request's metadata context.
    ``streamed``: FULL_DUPLEX_STREAMED body mode, the body in ``chunk``-byte pieces.
    An empty ``body`` is a request without body (headers end the stream)."""
    sent = {":method": "POST", ":path": path, "content-type": "application/json"}
    sent.update(headers or {})
    channel, own = _channel(target)
    stream = _Stream(channel, timeout)
    result = Pick()
    try:
        with_body = bool(body)
        stream.send(request_headers(sent, not with_body, subset, streamed))
        pieces = [body[i : i + chunk] for i in range(0, len(body), max(1, chunk))]
        if with_body and not streamed:
            first = stream.receive()
            if first is None:
                raise RuntimeError("the picker ended the stream without answering the headers")
            _read_pick(result, first)
            if result.status is not None:
                return result
            stream.send(body_message(body, True))
        elif with_body:
            for i, piece in enumerate(pieces):
                stream.send(body_message(piece, i == len(pieces) - 1))
        while (response := stream.receive()) is not None:
            _read_pick(result, response)
            if _done(response, streamed, with_body):
                break
        else:
            raise RuntimeError("the picker ended the stream before its decision")
        return result
    finally:
        stream.close()
        if own:
            channel.close()


async def apick(
    channel: grpc.aio.Channel,
    body: bytes,
    headers: dict[str, str] | None = None,
    subset: Sequence[str] | None = None,
    streamed: bool = False,
    chunk: int = 16384,
    path: str = "/v1/completions",
    timeout: float = 10.0,
) -> Pick:
    """``pick`` on an asyncio channel (``grpc.aio.insecure_channel``): the same messages and
    the same ``Pick``, without a thread per stream (benchmarks, many streams at once)."""
    sent = {":method": "POST", ":path": path, "content-type": "application/json"}
    sent.update(headers or {})
    call = pb_grpc.ExternalProcessorStub(channel).Process(timeout=timeout)
    result = Pick()
    try:
        with_body = bool(body)
        await call.write(request_headers(sent, not with_body, subset, streamed))
        if with_body and not streamed:
            first = await call.read()
            if first is grpc.aio.EOF:
                raise RuntimeError("the picker ended the stream without answering the headers")
            _read_pick(result, first)
            if result.status is not None:
                return result
            await call.write(body_message(body, True))
        elif with_body:
            pieces = [body[i : i + chunk] for i in range(0, len(body), max(1, chunk))]
            for i, piece in enumerate(pieces):
                await call.write(body_message(piece, i == len(pieces) - 1))
        while (response := await call.read()) is not grpc.aio.EOF:
            _read_pick(result, response)
            if _done(response, streamed, with_body):
                return result
        raise RuntimeError("the picker ended the stream before its decision")
    finally:
        call.cancel()


def exchange(
    target: str | grpc.Channel,
    messages: Sequence[pb.ProcessingRequest | bytes],
    timeout: float = 10.0,
    hold_open: bool = False,
) -> list[pb.ProcessingResponse]:
    """Sends ``messages`` (protos, or raw bytes sent as they are: malformed ones) on one stream
    and returns every answer until the picker ends it. A gRPC error raises ``grpc.RpcError``.
    ``hold_open``: the client does not half-close (the picker's own timeouts end it)."""
    channel, own = _channel(target)
    method = channel.stream_stream(
        "/envoy.service.ext_proc.v3.ExternalProcessor/Process",
        request_serializer=lambda m: m if isinstance(m, bytes) else m.SerializeToString(),
        response_deserializer=pb.ProcessingResponse.FromString,
    )
    done = threading.Event()

    def requests() -> Iterator:
        yield from messages
        if hold_open:
            done.wait(timeout)

    try:
        return list(method(requests(), timeout=timeout))
    finally:
        done.set()
        if own:
            channel.close()


def health(target: str | grpc.Channel, service: str = "", timeout: float = 5.0) -> str:
    """``SERVING``, ``NOT_SERVING``, ``UNKNOWN`` or ``SERVICE_UNKNOWN`` (not registered)."""
    channel, own = _channel(target)
    try:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            answer = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                return "SERVICE_UNKNOWN"
            raise
        return health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status)
    finally:
        if own:
            channel.close()
