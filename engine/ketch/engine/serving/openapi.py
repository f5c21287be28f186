"""The API server's OpenAPI document, with the request bodies the handlers actually accept.

The handlers read raw bodies (for the size limit, the read timeout and OpenAI-shaped errors),
so FastAPI cannot see their body models; this adds them: ``POST /v1/completions``,
``POST /v1/chat/completions``, ``POST /v1/embeddings``, ``POST /tokenize`` and
``POST /detokenize`` carry the JSON schema
of the pydantic models that ``protocol.parse_request`` validates with. Clients and fuzzers (the
test suite's) read it.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from ketch.engine.serving.protocol import ChatCompletionRequest, CompletionRequest
from ketch.engine.serving.routes.embeddings import EmbeddingRequest
from ketch.engine.serving.routes.tokenization import DetokenizeRequest, TokenizeRequest

BODIES: dict[str, type[BaseModel]] = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/embeddings": EmbeddingRequest,
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
}
_REF = "#/components/schemas/{model}"


def install(app: FastAPI) -> None:
    """Makes ``app.openapi()`` (``GET /openapi.json``) describe the request bodies."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = get_openapi(title=app.title, version=app.version, routes=app.routes)
            schemas = document.setdefault("components", {}).setdefault("schemas", {})
            for path, model in BODIES.items():
                schema = model.model_json_schema(ref_template=_REF)
                schemas.update(schema.pop("$defs", {}))
                schemas[model.__name__] = schema
                operation = document["paths"][path]["post"]
                operation["requestBody"] = {
                    "required": True,
                    "content": {
                        "application/json": {"schema": {"$ref": _REF.format(model=model.__name__)}}
                    },
                }
            app.openapi_schema = document
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
