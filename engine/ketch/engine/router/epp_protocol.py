"""The Gateway API Inference Extension's endpoint picker protocol on Envoy's ext_proc messages:
what the EPP reads from a ``ProcessingRequest`` and the ``ProcessingResponse`` messages it sends.

Read: the request's pseudo-headers (``:path``), the subset hint (``metadata_context``
namespace ``envoy.lb.subset_hint``, key ``x-gateway-destination-endpoint-subset``), the body
mode Envoy announced (``protocol_config``), and the OpenAI JSON body, checked for shape only
(the instance validates the rest). Written: the pick as the ``x-gateway-destination-endpoint``
header and the same value as ``envoy.lb`` dynamic metadata; refusals as ImmediateResponses.
Nothing here does I/O.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from ketch.engine.router.policies import MAX_PARSE_SEPARATORS, SEPARATORS, chunks_of

DESTINATION_HEADER = "x-gateway-destination-endpoint"
METADATA_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
STREAMED_CHUNK = 62_000  # echoed body pieces; some Envoy builds cap streamed chunks at 64 KiB
MAX_SUBSET = 4096  # subset hint entries read at most (an InferencePool's endpoints)
MAX_MODEL_CHARS = 256
_STREAMED = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/embeddings")


class Refusal(Exception):
    """A request the EPP answers itself with an ImmediateResponse (400, 413, 429, 503)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class Head:
    """What the EPP keeps of a request's headers message."""

    path: str
    subset: frozenset[str] | None  # None: no hint (any ready endpoint)
    streamed: bool  # FULL_DUPLEX_STREAMED request body (else buffered, or no body)
    echo_response: bool  # response bodies are streamed: echo each chunk back
    has_body: bool
    unsupported_mode: str | None = None  # a request body mode the EPP does not speak


def read_head(message: pb.ProcessingRequest) -> Head:
    """The request headers phase; a Refusal(400) for an unusable subset hint."""
    headers = message.request_headers
    path = ""
    for header in headers.headers.headers:
        if header.key == ":path":
            path = (header.raw_value or header.value.encode()).decode("latin-1")
            break
    config = message.protocol_config
    # Without a protocol_config (older Envoy) assume GAIE's recommended FULL_DUPLEX_STREAMED.
    announced = message.HasField("protocol_config")
    streamed = not announced or config.request_body_mode == _STREAMED
    echo = not announced or config.response_body_mode == _STREAMED
    mode = processing_mode_pb2.ProcessingMode.BodySendMode.Name(config.request_body_mode)
    spoken = ("BUFFERED", "FULL_DUPLEX_STREAMED", "NONE")
    return Head(
        path=path.split("?", 1)[0],
        subset=read_subset(message),
        streamed=streamed,
        echo_response=echo,
        has_body=not headers.end_of_stream,
        unsupported_mode=None if not announced or mode in spoken else mode,
    )


def read_subset(message: pb.ProcessingRequest) -> frozenset[str] | None:
    hints = message.metadata_context.filter_metadata
    if SUBSET_NAMESPACE not in hints or SUBSET_KEY not in hints[SUBSET_NAMESPACE].fields:
        return None
    value = hints[SUBSET_NAMESPACE].fields[SUBSET_KEY]
    kind = value.WhichOneof("kind")
    if kind == "string_value":  # tolerated: one "ip:port,ip:port" string
        items = [v.strip() for v in value.string_value.split(",")]
    elif kind == "list_value":
        items = []
        for entry in value.list_value.values:
            if entry.WhichOneof("kind") != "string_value":
                raise Refusal(400, f"{SUBSET_KEY} must be a list of ip:port strings")
            items.append(entry.string_value.strip())
    else:
        raise Refusal(400, f"{SUBSET_KEY} must be a list of ip:port strings")
    if len(items) > MAX_SUBSET:
        raise Refusal(400, f"{SUBSET_KEY} lists more than {MAX_SUBSET} endpoints")
    return frozenset(i for i in items if i)


@dataclass(frozen=True)
class Wanted:
    """What the pick needs from the body: the prompt's chunk hashes (prefix-hash), if any."""

    chunks: list[bytes] | None
    paired: bool  # needs a prefill and a decode instance in a P/D deployment
    model: str | None = None  # the model the body names


def read_body(path: str, body: bytes, chunk_chars: int, hash_prompt: bool) -> Wanted:
    """Checks an OpenAI request body's shape; a Refusal(400) names what is wrong with it.

    Bodies with more JSON separators than the router parses are taken unparsed (least-loaded
    pick; the instance judges them), as the router's HTTP path does."""
    paired = not path.endswith("/embeddings")
    if not body:
        return Wanted(None, paired)
    if sum(body.count(sep) for sep in SEPARATORS) > MAX_PARSE_SEPARATORS:
        return Wanted(None, paired)
    try:
        data = json.loads(body)
    except RecursionError:
        raise Refusal(400, "request body is nested too deeply") from None
    except ValueError as exc:  # UnicodeDecodeError is one
        raise Refusal(400, f"request body is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise Refusal(400, "request body must be a JSON object")
    model = data.get("model")
    if model is not None and (not isinstance(model, str) or len(model) > MAX_MODEL_CHARS):
        raise Refusal(400, f"'model' must be a string of at most {MAX_MODEL_CHARS} characters")
    _check_prompt(path, data)
    chunks = chunks_of(path, data, chunk_chars) if hash_prompt else None
    return Wanted(chunks, paired, model)


def _check_prompt(path: str, data: dict) -> None:
    if path.endswith("/chat/completions"):
        messages = data.get("messages")
        if messages is not None and not isinstance(messages, list):
            raise Refusal(400, "'messages' must be a list")
        return
    if path in _PATHS:
        key = "input" if path.endswith("/embeddings") else "prompt"
        prompt = data.get(key)
        if prompt is not None and not isinstance(prompt, str | list):
            raise Refusal(400, f"'{key}' must be a string or a list")


# ---------------------------------------------------------------- responses


def _header(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, raw_value=value.encode()),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )


def decision(
    endpoints: Sequence[str], extra: dict[str, str], remove: Sequence[str], phase: str
) -> pb.ProcessingResponse:
    """The pick, answering ``phase`` ("request_headers" or "request_body"): the header and the
    ``envoy.lb`` metadata carry the same ordered list; ``extra`` headers are set (overwriting
    any the client sent) and ``remove`` headers dropped."""
    value = ",".join(endpoints)
    mutation = pb.HeaderMutation(
        set_headers=[_header(DESTINATION_HEADER, value)]
        + [_header(k, v) for k, v in extra.items()],
        remove_headers=list(remove),
    )
    common = pb.CommonResponse(header_mutation=mutation, clear_route_cache=True)
    metadata = struct_pb2.Struct()
    metadata.update({METADATA_NAMESPACE: {DESTINATION_HEADER: value}})
    response = pb.ProcessingResponse(dynamic_metadata=metadata)
    if phase == "request_headers":
        response.request_headers.CopyFrom(pb.HeadersResponse(response=common))
    else:
        response.request_body.CopyFrom(pb.BodyResponse(response=common))
    return response


def immediate(status: int, message: str) -> pb.ProcessingResponse:
    """The EPP answers the client itself: OpenAI's error shape as the body."""
    body = {"error": {"message": message, "type": _kind(status), "param": None, "code": status}}
    headers = [_header("content-type", "application/json")]
    if status in (429, 503):
        headers.append(_header("retry-after", "1"))
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=status),
            headers=pb.HeaderMutation(set_headers=headers),
            body=json.dumps(body).encode(),
            details=f"ketch_epp_{status}",
        )
    )


def _kind(status: int) -> str:
    return "invalid_request_error" if status < 429 else "server_error"


def streamed_body(field: str, data: bytes, end_of_stream: bool) -> list[pb.ProcessingResponse]:
    """Body echoed back in FULL_DUPLEX_STREAMED mode, in pieces Envoy accepts; ``field`` is
    "request_body" or "response_body"."""
    pieces = [data[i : i + STREAMED_CHUNK] for i in range(0, len(data), STREAMED_CHUNK)] or [b""]
    out = []
    for i, piece in enumerate(pieces):
        last = end_of_stream and i == len(pieces) - 1
        mutation = pb.BodyMutation(
            streamed_response=pb.StreamedBodyResponse(body=piece, end_of_stream=last)
        )
        response = pb.ProcessingResponse()
        getattr(response, field).CopyFrom(
            pb.BodyResponse(response=pb.CommonResponse(body_mutation=mutation))
        )
        out.append(response)
    return out


def passed(field: str) -> pb.ProcessingResponse:
    """An answer that changes nothing, for ``field`` (a headers, body or trailers phase)."""
    response = pb.ProcessingResponse()
    kind = {"headers": pb.HeadersResponse, "body": pb.BodyResponse, "trailers": pb.TrailersResponse}
    getattr(response, field).CopyFrom(kind[field.rsplit("_", 1)[1]]())
    return response
