"""Structured outputs: grammars that constrain what a request may generate.

``grammars`` turns what a client asks for (a JSON schema, any JSON object, a regex, a list of
choices, a Lark or GBNF grammar) into one grammar text, which is what ``SamplingParams.grammar``
carries between processes. ``compiler`` compiles that text for one model's vocabulary (cached by
text, on a thread of its own) and keeps each request's matcher: the tokens allowed next, advanced
by every token the request accepts. The grammar engine is llguidance (docs/structured_outputs.md
says why).
"""
