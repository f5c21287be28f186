"""Where a request's trace record lives while tracing is on: the key of its ASGI scope. A leaf,
shared by the no-op side (``tracing``) and the SDK side (``tracing_otel``)."""

SCOPE_KEY = "ketch.trace"  # the request's trace record, in its ASGI scope (tracing on only)
