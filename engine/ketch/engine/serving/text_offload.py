"""Tokenising, detokenising and chat rendering for every endpoint, inline or on a thread.

A long text (more than ``INLINE_CHARS``, ``INLINE_TOKENS`` or, for a chat, ``INLINE_BYTES`` of
request body) is worked on a thread (``ServingState.text_jobs``), where ``tokenizers`` releases
the GIL, so the event loop keeps answering; a short one inline, where a thread would cost more
than the work.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ketch.engine.serving.protocol import ChatMessage, ProtocolError
from ketch.engine.tokenizer import RELEASE_GIL_CHARS, RELEASE_GIL_TOKENS

if TYPE_CHECKING:
    from ketch.engine.serving.state import ServingState

INLINE_CHARS = RELEASE_GIL_CHARS
"""Texts up to this long are tokenised on the event loop (about 3 ms at most)."""
INLINE_TOKENS = RELEASE_GIL_TOKENS
"""Token lists up to this long are detokenised (or given token strings) on the event loop."""
INLINE_BYTES = 4096
"""Chats whose request body is up to this long are rendered and tokenised on the event loop."""


async def encode(state: ServingState, text: str, add_special_tokens: bool = True) -> list[int]:
    """``text``'s token ids, on a thread if it is long."""
    if len(text) <= INLINE_CHARS:
        return state.tokenizer.encode(text, add_special_tokens)
    return await state.text_jobs.run(state.tokenizer.encode, text, add_special_tokens)


async def decode(state: ServingState, token_ids: list[int], skip_special_tokens: bool) -> str:
    """The text of ``token_ids``, on a thread if they are many."""
    if len(token_ids) <= INLINE_TOKENS:
        return state.tokenizer.decode(token_ids, skip_special_tokens)
    return await state.text_jobs.run(state.tokenizer.decode, token_ids, skip_special_tokens)


async def render_chat(
    state: ServingState,
    messages: Sequence[ChatMessage],
    add_generation_prompt: bool,
    size: int,
    add_special_tokens: bool = False,
    variables: Mapping[str, Any] | None = None,
) -> list[int]:
    """A chat rendered with the model's template and tokenised; on a thread when its request
    body was over ``INLINE_BYTES``. ``variables`` are the template's others (``tools``, a
    request's ``chat_template_kwargs``). A 400 naming ``messages`` when the template cannot
    render it (whatever the template raised)."""
    tokenizer = state.tokenizer
    extra = dict(variables or {})

    def work() -> list[int]:
        conversation = [m.model_dump(exclude_none=True) for m in messages]
        text = tokenizer.apply_chat_template(conversation, add_generation_prompt, **extra)
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)

    try:
        return work() if size <= INLINE_BYTES else await state.text_jobs.run(work)
    except ValueError as exc:
        raise ProtocolError(400, str(exc), param="messages") from None
