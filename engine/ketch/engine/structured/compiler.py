"""Compiles grammars for one model's vocabulary and keeps each request's matcher.

``GrammarCompiler`` builds llguidance's view of the tokenizer once (a few hundred milliseconds
at a 32k vocabulary), caches compiled grammars by their text (a request with a schema seen
before costs a copy, about two microseconds), and compiles on a thread of its own, so a new
grammar never stalls the step loop: the worker asks for a matcher when a request arrives and
waits for it only when the request's first token is sampled, after its prefill ran.

``RequestGrammar`` is one request's matcher: the mask of tokens allowed next (end of sequence
only where the grammar accepts what came before) and ``accept`` for each token sampled.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import llguidance
import llguidance.numpy as llnp
import numpy as np

logger = logging.getLogger(__name__)

CACHE_SIZE = 256
"""Compiled grammars kept per model (least recently used dropped first)."""


class GrammarError(ValueError):
    """A grammar that does not compile against this model's vocabulary; the text says why."""


class GrammarCompiler:
    """One model's grammar compiler: its llguidance tokenizer, a cache of compiled grammars by
    text, and the thread that compiles them."""

    def __init__(
        self,
        tokenizer_file: Path,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        cache_size: int = CACHE_SIZE,
    ) -> None:
        self.tokenizer_file = tokenizer_file
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.cache_size = cache_size
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.LLTokenizer(
                    self.tokenizer_file.read_text(),
                    n_vocab=self.vocab_size,
                    eos_token=self.eos_token_ids or None,
                )
            return self._tokenizer

    def check(self, grammar: str) -> None:
        """Compiles ``grammar`` (kept in the cache); GrammarError naming the problem if it does
        not compile. Blocking: call it from a thread, not an event loop."""
        self._template(grammar)

    def matcher(self, grammar: str, consumed: Sequence[int] = ()) -> RequestGrammar:
        """A request's matcher, compiled on the compiler's thread, resumed past ``consumed``
        (output tokens sampled elsewhere, e.g. the first token on a prefill peer)."""
        future = self._thread.submit(self._start, grammar, list(consumed))
        return RequestGrammar(future, self.vocab_size, self.eos_token_ids)

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)

    def _start(self, grammar: str, consumed: list[int]) -> llguidance.LLMatcher:
        matcher = self._template(grammar).deep_copy()
        if consumed and not matcher.consume_tokens(consumed):
            raise GrammarError(f"the tokens generated so far break the grammar: {_why(matcher)}")
        return matcher

    def _template(self, grammar: str) -> llguidance.LLMatcher:
        with self._lock:
            template = self._compiled.get(grammar)
            if template is not None:
                self._compiled.move_to_end(grammar)
                return template
        template = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if template.is_error():
            raise GrammarError(_why(template))
        with self._lock:
            self._compiled[grammar] = template
            while len(self._compiled) > self.cache_size:
                self._compiled.popitem(last=False)
        return template


class RequestGrammar:
    """One request's grammar state: which tokens may come next, advanced by each accepted one."""

    def __init__(
        self, future: Future[llguidance.LLMatcher], vocab_size: int, eos_token_ids: list[int]
    ) -> None:
        self._future = future
        self._matcher: llguidance.LLMatcher | None = None
        self._bitmask = llnp.allocate_token_bitmask(1, vocab_size)
        self._vocab_size = vocab_size
        self._eos = np.asarray(eos_token_ids, dtype=np.int64)

    def ready(self) -> str | None:
        """Waits until the grammar is compiled; why it cannot be used, or None."""
        if self._matcher is None:
            try:
                self._matcher = self._future.result()
            except Exception as exc:
                return str(exc) if isinstance(exc, GrammarError) else f"{type(exc).__name__}: {exc}"
        return None

    def allowed(self) -> np.ndarray:
        """A bool per vocabulary token: may it come next. A matcher that broke (it cannot
        happen by sampling from this mask) allows only end of sequence, so the request ends."""
        matcher = self._ready_matcher()
        llnp.fill_next_token_bitmask(matcher, self._bitmask)
        bits = np.unpackbits(self._bitmask[0].view(np.uint8), bitorder="little")
        allowed = bits[: self._vocab_size].astype(bool)
        if matcher.is_error() or not allowed.any():
            logger.warning("grammar matcher failed (%s); ending the request", _why(matcher))
            allowed[:] = False
            allowed[self._eos[self._eos < self._vocab_size]] = True
        return allowed

    def accept(self, token: int) -> None:
        """Advances the matcher past ``token`` (sampled from ``allowed``)."""
        matcher = self._ready_matcher()
        if not matcher.is_stopped():  # after the grammar completed only EOS follows
            matcher.consume_token(token)

    def _ready_matcher(self) -> llguidance.LLMatcher:
        problem = self.ready()
        if problem is not None or self._matcher is None:
            raise GrammarError(problem or "no matcher")
        return self._matcher


def _why(matcher: llguidance.LLMatcher) -> str:
    return matcher.get_error() or "the grammar admits no token"
