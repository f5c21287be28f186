"""What the API server's endpoints share: one ``ServingState`` per server process.

``ketch serve`` builds it once the engine is ready (``serve.serve``), ``api_server.create_app``
hangs it on the app, and each endpoint module (``serving/routes/``) reads it with
``serving_state(request)``. Admission to the server (``ServingState.admit``) lives here too:
it reads the state's draining and paused flags and counts the request in ``in_flight``.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from fastapi import Request

from ketch.engine.engine_client import EngineClient
from ketch.engine.metrics import EngineMetrics
from ketch.engine.request_checks import PromptLimits
from ketch.engine.serving.admission import Slot
from ketch.engine.serving.config import ServerConfig
from ketch.engine.serving.guided import GrammarService
from ketch.engine.serving.offload import NOT_ACCEPTED, ThreadJobs
from ketch.engine.serving.pairing import PrefillPeers
from ketch.engine.serving.protocol import ProtocolError
from ketch.engine.tokenizer import Tokenizer


@dataclass
class ServingState:
    """Everything the endpoints share; one per server process."""

    config: ServerConfig
    engine: EngineClient
    tokenizer: Tokenizer
    model_name: str
    metrics: EngineMetrics
    max_model_len: int
    vocab_size: int = 0  # the model's, as the engine announced it
    hidden_size: int = 0  # the model's (its embeddings' size), as the engine announced it
    api_key: str | None = None
    admin_key: str | None = None  # for /pause and /resume; None: refused to everyone
    reasoning_parser: str | None = None  # chosen at startup (``reasoning.choose``); None: off
    in_flight: int = 0
    draining: bool = False
    paused: bool = False
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    prefill_peers: PrefillPeers = field(default_factory=lambda: PrefillPeers(None))
    grammars: GrammarService | None = None  # structured outputs' checks (``create_app``)
    # Tokenising, detokenising and chat-rendering long texts, off the event loop.
    text_jobs: ThreadJobs = field(default_factory=lambda: ThreadJobs("tokenizing"))

    def close(self) -> None:
        """Stops the worker processes and threads (the server is stopping)."""
        if self.grammars is not None:
            self.grammars.close()
        self.text_jobs.close()

    def set_idle(self, idle: bool) -> None:
        if idle:
            self.idle.set()
        else:
            self.idle.clear()

    @property
    def prompt_limits(self) -> PromptLimits:
        """The model's vocabulary and context, as the engine announced them."""
        return PromptLimits(self.vocab_size or self.tokenizer.vocab_size, self.max_model_len)

    def admit(self) -> Slot:
        """The request's slot, if the server takes requests now (503 or 429 otherwise)."""
        if self.draining:
            message = "the server is shutting down; retry on another instance"
            raise ProtocolError(503, message, code=NOT_ACCEPTED)
        if self.paused:
            message = "the server is paused; retry shortly or on another instance"
            raise ProtocolError(503, message, code=NOT_ACCEPTED)
        if not self.engine.is_alive:
            raise ProtocolError(503, "the engine is not running", code=NOT_ACCEPTED)
        return Slot(self)


def serving_state(request: Request) -> ServingState:
    """The state of the server ``request`` came to (``create_app`` put it on the app)."""
    return request.app.state.serving
