"""Online serving: the OpenAI-compatible protocol (requests, errors, responses) and the server."""
