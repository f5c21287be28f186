"""Incremental detokenisation with stop-string detection.

Text is produced a token at a time without re-decoding the whole output: only a short window of
recent tokens is decoded, and a window ending in an incomplete UTF-8 sequence waits for more
tokens. When the request has stop strings, the last ``len(longest stop) - 1`` characters are
held back from streaming so a stop string split across tokens is never shown.
"""

from __future__ import annotations

from ketch.engine.tokenizer import Tokenizer

_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns one request's output tokens into text, a delta at a time."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        stop: list[str],
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._token_texts = tokenizer.token_texts(skip_special_tokens)
        self._concatenates = tokenizer.byte_level
        self._tokens = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._tokens)
        self._stop = stop
        self._holdback = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self._emitted = 0
        self.stop_string: str | None = None

    def add_token(self, token_id: int) -> bool:
        """Appends a token's text; returns True if a stop string ended the output."""
        tokens = self._tokens
        tokens.append(token_id)
        delta = self._new_text(tokens)
        if delta is None:
            return False  # an incomplete character (or nothing visible yet): wait
        self._prefix_offset = self._read_offset
        self._read_offset = len(tokens)
        if not self._stop:
            self.text += delta
            return False
        search_from = max(0, len(self.text) - self._holdback)
        self.text += delta
        return self._check_stop(search_from)

    def _new_text(self, tokens: list[int]) -> str | None:
        """What the tokens after the read offset add to the text after the prefix window's
        (``decode(window + new)`` less ``decode(window)``); None while that is nothing or ends
        in an incomplete character."""
        start, read = self._prefix_offset, self._read_offset
        skip = self._skip
        if read - start == 1:  # the usual case, one token a step: its text is remembered
            texts = self._token_texts
            prefix = texts.get(tokens[start])
            if prefix is None:
                prefix = self._tokenizer.decode_token(tokens[start], skip)
            if self._concatenates and len(tokens) - read == 1 and "\ufffd" not in prefix:
                # Byte-level: decode([a, b]) is decode([a]) + decode([b]) when a's text is
                # whole (its bytes valid UTF-8), so neither is decoded again.
                new = texts.get(tokens[read])
                if new is None:
                    new = self._tokenizer.decode_token(tokens[read], skip)
                return new if new and new[-1] != "\ufffd" else None
        else:
            prefix = self._tokenizer.decode(tokens[start:read], skip)
        full = self._tokenizer.decode(tokens[start:], skip)
        if len(full) <= len(prefix) or full[-1] == "\ufffd":
            return None
        return full[len(prefix) :]

    def _check_stop(self, search_from: int) -> bool:
        # The earliest stop string in the text wins, whatever its place in the list.
        hits = [(at, s) for s in self._stop if (at := self.text.find(s, search_from)) != -1]
        if not hits:
            return False
        at, self.stop_string = min(hits, key=lambda hit: hit[0])
        self.text = self.text[:at]
        return True

    @property
    def has_stop_strings(self) -> bool:
        return bool(self._stop)

    def add_tokens_unchecked(self, token_ids: list[int]) -> None:
        """Queues many tokens at once, without stop-string checks; ``finish`` decodes them."""
        self._tokens.extend(token_ids)

    def finish(self) -> None:
        """Flushes tokens still waiting to complete a character (shown as U+FFFD, as decode does).

        Not called after a stop string: the text is already cut there.
        """
        if self.stop_string is None and self._read_offset < len(self._tokens):
            decode = self._tokenizer.decode
            prefix = decode(self._tokens[self._prefix_offset : self._read_offset], self._skip)
            full = decode(self._tokens[self._prefix_offset :], self._skip)
            self.text += full[len(prefix) :]
            self._prefix_offset = self._read_offset = len(self._tokens)

    def take_delta(self, finished: bool) -> str:
        """Text not yet handed out; keeps back a possible stop-string prefix until finished."""
        end = len(self.text) if finished else max(self._emitted, len(self.text) - self._holdback)
        delta = self.text[self._emitted : end]
        self._emitted = end
        return delta
