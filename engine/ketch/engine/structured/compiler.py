"""Compiles grammars for one model's vocabulary and keeps each request's matcher.

``GrammarCompiler`` builds llguidance's view of the tokenizer once (a few hundred milliseconds
at a 32k vocabulary), caches compiled grammars by their text (a request with a schema seen
before costs a copy, about two microseconds), and compiles on a small pool of threads of its
own (``COMPILE_THREADS``), so a new grammar never stalls the step loop: the worker asks for a
matcher when a request arrives, and when the request's first token is to be sampled waits a few
milliseconds at most (``wait_compiled``); a request whose matcher is still not ready skips that
step's token and is tried again the next step, and fails alone past a deadline
(``ketch.engine.worker.model_runner``). Every compile runs under ``PARSER_LIMITS``, tighter than
llguidance's defaults, which bound a grammar's memory and the cost of each step's mask.

``RequestGrammar`` is one request's matcher: the mask of tokens allowed next (end of sequence
only where the grammar accepts what came before) and ``accept`` for each token sampled.

``next_bitmasks`` gives a batch's masks and keeps them until the matchers advance. Masks are
the costly part (15-20 microseconds a request and step here, against about one to advance a
matcher) and depend only on the tokens accepted so far, so the worker computes the next step's
while the engine schedules it (``ModelRunner.prepare_next_step``); the sampler then finds them.
A request not sampled next step (preempted, finished, failed) keeps or drops its mask.
(A thread computing them during the forward pass was measured slower: the forward is mostly
Python, and handing the GIL back and forth between the two cost more than the masks.)
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import llguidance
import llguidance.numpy as llnp
import numpy as np

from ketch.engine.tokenizer import tokenizer_json

logger = logging.getLogger(__name__)

CACHE_SIZE = 256
"""Compiled grammars kept per model (least recently used dropped first)."""

COMPILE_THREADS = 2
"""Threads compiling grammars. llguidance drops the GIL while it builds a grammar (measured: the
step loop's Python runs on during a compile, and Lark grammars compiled 1.4-1.9x faster on two
threads than on one; JSON schemas gained little), and two threads mean one slow grammar does
not hold up every grammar queued behind it. More would take cores from the model's own threads."""

PENDING = "still compiling"
"""``RequestGrammar.problem`` of a grammar whose compile has not finished (nor run out of time)."""
UNUSABLE = "the grammar cannot be used: "
"""How a request's failure starts when its grammar did not compile (in time) in the worker:
the engine answers it as the sender's fault (400), not an internal error."""

PARSER_LIMITS = {
    "max_lexer_states": 50_000,  # default 250_000; about 1-2 kB of memory each
    "step_lexer_fuel": 100_000,  # default 200_000; ~14k a millisecond: one step's mask ~7 ms
    "step_max_items": 20_000,  # default 50_000; ~20k a millisecond: one step's mask ~1 ms
    "max_grammar_size": 100_000,  # default 500_000 symbols (the API server bounds the text too)
    "verbose_errors": False,  # errors without the parser's state (the request's tokens, the
    # grammar's text), which the worker logs
}
"""llguidance's ``LLParserLimits`` for every compile (the API server's check and the worker's
matchers alike, so a grammar the check accepts compiles in the worker). Chosen 2-5x above what
typical JSON schemas, regexes and Lark grammars needed at a 32k vocabulary (random walks of up
to 300 tokens each); a grammar over a limit fails its own request (a compile error, or the
matcher breaks and the request ends)."""


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
        self._limits = llguidance.LLParserLimits(**PARSER_LIMITS)
        self._threads = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="grammar")

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.LLTokenizer(
                    tokenizer_json(self.tokenizer_file),
                    n_vocab=self.vocab_size,
                    eos_token=self.eos_token_ids or None,
                )
            return self._tokenizer

    def check(self, grammar: str) -> None:
        """Compiles ``grammar`` (kept in the cache); GrammarError naming the problem if it does
        not compile. Blocking: call it from a thread, not an event loop."""
        self._template(grammar)

    def matcher(self, grammar: str, consumed: Sequence[int] = ()) -> RequestGrammar:
        """A request's matcher, compiled on the compiler's threads, resumed past ``consumed``
        (output tokens sampled elsewhere, e.g. the first token on a prefill peer)."""
        future = self._threads.submit(self._start, grammar, list(consumed))
        return RequestGrammar(future, self.vocab_size, self.eos_token_ids)

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)

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
        template = self._compile(grammar)
        if template.is_error():
            raise GrammarError(_why(template))
        with self._lock:
            self._compiled[grammar] = template
            while len(self._compiled) > self.cache_size:
                self._compiled.popitem(last=False)
        return template

    def _compile(self, grammar: str) -> llguidance.LLMatcher:
        """One compile (the costly part: up to about a second for a complex grammar)."""
        return llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=self._limits)


class RequestGrammar:
    """One request's grammar state: which tokens may come next (``next_bitmasks``), advanced
    by each accepted token."""

    def __init__(
        self, future: Future[llguidance.LLMatcher], vocab_size: int, eos_token_ids: list[int]
    ) -> None:
        self._future = future
        self.submitted = time.monotonic()  # when its compile was asked for
        self.matcher: llguidance.LLMatcher | None = None  # once compiled (``ready``)
        self.vocab_size = vocab_size
        self._eos = np.asarray(eos_token_ids, dtype=np.int64)
        self._masks: np.ndarray | None = None  # the next token's mask is row ``_row`` of it
        self._row = 0

    @property
    def compiled(self) -> bool:
        """Whether ``ready`` answers at once (the compile finished, or failed)."""
        return self.matcher is not None or self._future.done()

    def ready(self) -> str | None:
        """Waits until the grammar is compiled; why it cannot be used, or None. (The worker
        calls it only once ``compiled``: it never waits there.)"""
        if self.matcher is None:
            try:
                self.matcher = self._future.result()
            except Exception as exc:
                return str(exc) if isinstance(exc, GrammarError) else f"{type(exc).__name__}: {exc}"
        return None

    def problem(self, now: float, deadline_s: float) -> str | None:
        """None when the grammar can be used; ``PENDING`` while it is still compiling within
        ``deadline_s`` of being asked for; else why it cannot be used. Never waits."""
        if self.compiled:
            return self.ready()  # at once: it is compiled (or failed)
        if now - self.submitted < deadline_s:
            return PENDING
        return (
            f"it did not compile within {deadline_s:g} s (too complex, or too many grammars "
            "compiling at once)"
        )

    def cancel(self) -> None:
        """The request is gone: its compile is dropped if it has not started."""
        self._future.cancel()

    def allowed(self) -> np.ndarray:
        """A bool per vocabulary token: may it come next."""
        bits = np.unpackbits(next_bitmasks([self])[0].view(np.uint8), bitorder="little")
        return bits[: self.vocab_size].view(bool)

    def accept(self, token: int) -> None:
        """Advances the matcher past ``token`` (sampled from its mask)."""
        matcher = self._ready_matcher()
        self._masks = None
        if not matcher.is_stopped():  # after the grammar completed only EOS follows
            matcher.consume_token(token)

    def _ready_matcher(self) -> llguidance.LLMatcher:
        if self.matcher is None:
            problem = self.ready()
            if problem is not None or self.matcher is None:
                raise GrammarError(problem or "no matcher")
        return self.matcher

    def _end_only(self, mask: np.ndarray) -> None:
        """Makes ``mask`` allow end of sequence only: the matcher broke (which sampling from its
        masks cannot do), so the request ends."""
        logger.warning("grammar matcher failed (%s); ending the request", _why(self.matcher))
        words = mask.view(np.uint32)
        words[:] = 0
        for token in self._eos[self._eos < self.vocab_size].tolist():
            words[token >> 5] |= np.uint32(1 << (token & 31))


def next_bitmasks(grammars: Sequence[RequestGrammar]) -> np.ndarray:
    """The tokens each of ``grammars`` allows next: [len(grammars), words] int32, one bit a
    token (token t at bit t % 32 of word t // 32, llguidance's layout). Kept until a matcher
    advances: asked again for the same grammars in the same order (the sampler, after
    ``prepare_next_step``), the same array comes back, else one is gathered, computing only the
    masks not computed yet. A matcher that broke allows only end of sequence."""
    matchers = [g._ready_matcher() for g in grammars]
    masks = grammars[0]._masks
    if (
        masks is not None
        and len(masks) == len(grammars)
        and all(g._masks is masks and g._row == row for row, g in enumerate(grammars))
    ):
        return masks
    masks = np.zeros(llnp.get_bitmask_shape(len(grammars), grammars[0].vocab_size), np.int32)
    fresh = []
    for row, (grammar, matcher) in enumerate(zip(grammars, matchers, strict=True)):
        if grammar._masks is None:
            matcher.unsafe_compute_mask_ptr(masks[row].ctypes.data, masks[row].nbytes)
            fresh.append(row)
        else:
            masks[row] = grammar._masks[grammar._row]
        grammar._masks, grammar._row = masks, row
    if fresh:
        empty = ~masks[fresh].any(axis=1)
        for row, none in zip(fresh, empty.tolist(), strict=True):
            if none or matchers[row].is_error():
                grammars[row]._end_only(masks[row])
    return masks


def wait_compiled(grammars: Sequence[RequestGrammar], timeout: float) -> None:
    """Waits until every one of ``grammars`` is ``compiled``, or ``timeout`` seconds."""
    pending = [g._future for g in grammars if not g.compiled]
    if pending and timeout > 0:
        concurrent.futures.wait(pending, timeout=timeout)


def precompute_masks(grammars: Sequence[RequestGrammar]) -> None:
    """``next_bitmasks`` ahead of time (off the step's critical path); a failure is logged and
    left to the sampler, which fails the request when it asks again."""
    try:
        if grammars:
            next_bitmasks(grammars)
    except Exception:
        logger.exception("computing the next grammar masks failed")


def _why(matcher: llguidance.LLMatcher) -> str:
    return matcher.get_error() or "the grammar admits no token"
