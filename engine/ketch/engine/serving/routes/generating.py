"""What the two generation endpoints (completions and chat completions) share: the request's
grammar, prepared off the event loop, and the SSE response that owns the request's slot."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse

from ketch.engine.serving import responses as R
from ketch.engine.serving.admission import Slot
from ketch.engine.serving.guided import GuidedError
from ketch.engine.serving.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ProtocolError,
    error_body,
)
from ketch.engine.serving.state import ServingState


async def prepare_grammar(
    state: ServingState, body: CompletionRequest | ChatCompletionRequest
) -> None:
    """Builds and compiles the request's grammar, if it asks for one, off the event loop
    (``GrammarService``); a 400 naming the field if it is too big, wrong, does not compile for
    this model or takes longer than --grammar-timeout."""
    assert state.grammars is not None  # create_app made it
    try:
        await state.grammars.prepare(body)
    except GuidedError as exc:
        raise ProtocolError(400, str(exc), exc.param) from None


def sse_response(slot: Slot, events: AsyncIterator[str]) -> StreamingResponse:
    """The stream owns ``slot`` from here: released when it ends, or when it is dropped unsent."""

    async def body() -> AsyncIterator[str]:
        try:
            try:
                async for event in events:
                    yield event
            except ProtocolError as exc:  # headers are sent: report in-stream, then stop
                yield R.sse(error_body(exc))
            yield R.sse("[DONE]")
        finally:
            slot.release()

    stream = body()
    slot.release_with(stream)
    return StreamingResponse(stream, media_type="text/event-stream")
