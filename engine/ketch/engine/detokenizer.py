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
        start, read = self._prefix_offset, self._read_offset
        if read - start == 1:  # the usual case, one token a step: its text is remembered
            prefix = self._token_texts.get(tokens[start])
            if prefix is None:
                prefix = self._tokenizer.decode_token(tokens[start], self._skip)
        else:
            prefix = self._tokenizer.decode(tokens[start:read], self._skip)
        full = self._tokenizer.decode(tokens[start:], self._skip)
        if len(full) <= len(prefix) or full[-1] == "\ufffd":
            return False  # an incomplete character (or nothing visible yet): wait
        self._prefix_offset = read
        self._read_offset = len(tokens)
        if not self._stop:
            self.text += full[len(prefix) :]
            return False
        search_from = max(0, len(self.text) - self._holdback)
        self.text += full[len(prefix) :]
        return self._check_stop(search_from)

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
