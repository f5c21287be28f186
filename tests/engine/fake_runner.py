"""A fake model runner for scheduler tests: simulated KV blocks, outputs fixed by token history.

The fake behaves like ``ketch.engine.worker.model_runner`` towards the scheduler: it keeps its own
copy of every request (tokens, block table, progress) from ``new_requests`` and
``cached_requests``, and appends each token it samples to its own token list. Instead of a model
it simulates the KV cache: the entry written for position ``p`` is ``kv_entry(entry at p - 1,
token p)``, where the entry at ``p - 1`` is *read from the KV block* the block table points at,
as attention would read it. The sampled token is derived from the last entry, so it is a pure
function of the request's whole token history, and a wrong block table (a prefix-cache hit on the
wrong content, a block overwritten by another request) changes the output or raises.

Every step it also raises ``FakeRunnerError`` if the scheduler's message is inconsistent with what
it holds: blocks that do not cover the positions computed, block 0 in a table, a block written
this step that another live request also holds, a block shared by two live requests that is not a
fully computed block at the same position in both (a prefix-cache share), or KV contents that do
not match the tokens.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ketch.engine.core.scheduler_output import ModelRunnerOutput, NewRequestData, SchedulerOutput

VOCAB_SIZE = 512
KV_SEED = 0x5EED
"""The entry 'before' position 0."""


class FakeRunnerError(AssertionError):
    """The scheduler sent the runner something inconsistent."""


def kv_entry(previous: int, token: int) -> int:
    """The simulated KV entry of a token, given the entry of the token before it."""
    return hash((previous, token))


def sample_token(entry: int, vocab_size: int = VOCAB_SIZE) -> int:
    """The greedy 'model output' after a token whose KV entry is ``entry``."""
    return entry % vocab_size


def reference_output(
    prompt: Iterable[int],
    max_tokens: int,
    max_model_len: int,
    stop_token_ids: frozenset[int] = frozenset(),
    vocab_size: int = VOCAB_SIZE,
) -> list[int]:
    """What the fake model generates for one request in a plain loop (no scheduler, no cache).

    ``stop_token_ids`` end generation after the token is emitted (EOS without ``ignore_eos``).
    """
    tokens = list(prompt)
    entry = KV_SEED
    for token in tokens:
        entry = kv_entry(entry, token)
    output: list[int] = []
    while True:
        token = sample_token(entry, vocab_size)
        output.append(token)
        tokens.append(token)
        if token in stop_token_ids or len(output) >= max_tokens or len(tokens) >= max_model_len:
            return output
        entry = kv_entry(entry, token)


@dataclass
class _RequestState:
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    entries: list[int]
    """The KV entry each token must have, computed from the runner's own token list."""

    def expected_entries(self, end: int) -> list[int]:
        entries = self.entries
        previous = entries[-1] if entries else KV_SEED
        for token in self.token_ids[len(entries) : end]:
            previous = kv_entry(previous, token)
            entries.append(previous)
        return entries


class FakeRunner:
    """Stands in for ``ModelRunner.execute`` and checks the scheduler's block tables."""

    def __init__(self, block_size: int, vocab_size: int = VOCAB_SIZE) -> None:
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.requests: dict[str, _RequestState] = {}
        self.kv: dict[int, list[int | None]] = {}
        self.num_steps = 0
        self.num_tokens_computed = 0
        self.num_resumed_with_hits = 0

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self._apply_changes(sched)
        owners = self._check_block_tables()
        request_ids: list[str] = []
        sampled: list[int] = []
        total = 0
        for request_id, n in sched.num_scheduled_tokens.items():
            state = self.requests.get(request_id)
            if state is None:
                raise FakeRunnerError(f"{request_id} scheduled but unknown to the runner")
            self._check_step(request_id, state, n, owners)
            last_entry = self._compute(request_id, state, n)
            total += n
            if state.num_computed_tokens == len(state.token_ids):
                token = sample_token(last_entry, self.vocab_size)
                state.token_ids.append(token)
                request_ids.append(request_id)
                sampled.append(token)
        if total != sched.total_num_scheduled_tokens:
            raise FakeRunnerError(
                f"scheduled {total} tokens, total_num_scheduled_tokens says "
                f"{sched.total_num_scheduled_tokens}"
            )
        self.num_steps += 1
        self.num_tokens_computed += total
        return ModelRunnerOutput(request_ids=request_ids, sampled_token_ids=sampled)

    # ---- the scheduler's changes ----

    def _apply_changes(self, sched: SchedulerOutput) -> None:
        for request_id in sched.finished_request_ids:
            if self.requests.pop(request_id, None) is None:
                raise FakeRunnerError(f"finished {request_id} was never sent to the runner")
        for request_id in sched.preempted_request_ids:
            # Its blocks went back to the pool: the old table must never be used again.
            state = self.requests.get(request_id)
            if state is None:
                raise FakeRunnerError(f"preempted {request_id} was never sent to the runner")
            state.block_ids = []
            state.num_computed_tokens = 0
        for new in sched.new_requests:
            if new.request_id in self.requests:
                raise FakeRunnerError(f"{new.request_id} sent as new twice")
            self.requests[new.request_id] = _new_state(new)
        cached = sched.cached_requests
        for request_id, blocks, resumed, computed in zip(
            cached.request_ids,
            cached.new_block_ids,
            cached.resumed,
            cached.num_computed_tokens,
            strict=True,
        ):
            state = self.requests.get(request_id)
            if state is None:
                raise FakeRunnerError(f"cached {request_id} is unknown to the runner")
            if resumed:
                state.block_ids = list(blocks or [])
                self.num_resumed_with_hits += computed > 0
            else:
                if computed != state.num_computed_tokens:
                    raise FakeRunnerError(
                        f"{request_id}: scheduler says {computed} tokens computed, "
                        f"the runner computed {state.num_computed_tokens}"
                    )
                if blocks:
                    state.block_ids.extend(blocks)
            state.num_computed_tokens = computed

    # ---- checks ----

    def _check_block_tables(self) -> dict[int, list[tuple[str, int]]]:
        """Maps each block in a live table to its (request, index) holders; checks sharing."""
        owners: dict[int, list[tuple[str, int]]] = {}
        for request_id, state in self.requests.items():
            for index, block_id in enumerate(state.block_ids):
                owners.setdefault(block_id, []).append((request_id, index))
        if 0 in owners:
            raise FakeRunnerError(f"reserved block 0 in the table of {owners[0]}")
        bs = self.block_size
        for block_id, holders in owners.items():
            if len(holders) < 2:
                continue
            indexes = {index for _, index in holders}
            full = all(
                (index + 1) * bs <= self.requests[rid].num_computed_tokens for rid, index in holders
            )
            if len(indexes) != 1 or not full:
                raise FakeRunnerError(
                    f"block {block_id} shared by {holders} but is not a computed prefix block"
                )
        return owners

    def _check_step(
        self,
        request_id: str,
        state: _RequestState,
        n: int,
        owners: dict[int, list[tuple[str, int]]],
    ) -> None:
        bs = self.block_size
        begin, end = state.num_computed_tokens, state.num_computed_tokens + n
        if n <= 0 or end > len(state.token_ids):
            raise FakeRunnerError(
                f"{request_id}: {n} tokens scheduled from {begin}, it has {len(state.token_ids)}"
            )
        if len(state.block_ids) * bs < end:
            raise FakeRunnerError(
                f"{request_id}: {len(state.block_ids)} blocks cannot hold positions up to {end}"
            )
        for block_id in state.block_ids[begin // bs : (end - 1) // bs + 1]:
            if len(owners[block_id]) != 1:
                raise FakeRunnerError(
                    f"{request_id} writes block {block_id}, also held by {owners[block_id]}"
                )

    # ---- the 'model' ----

    def _compute(self, request_id: str, state: _RequestState, n: int) -> int:
        """Reads the KV of positions before the chunk, writes the chunk's; returns its last."""
        bs = self.block_size
        begin = state.num_computed_tokens
        end = begin + n
        expected = state.expected_entries(end)
        table = state.block_ids
        for i in range(-(-begin // bs)):
            stored = self.kv.get(table[i])
            lo, hi = i * bs, min((i + 1) * bs, begin)
            if stored is None or stored[: hi - lo] != expected[lo:hi]:
                raise FakeRunnerError(
                    f"{request_id}: KV block {table[i]} (positions {lo}-{hi - 1}) holds "
                    "entries of other tokens"
                )
        previous = expected[begin - 1] if begin else KV_SEED
        tokens = state.token_ids
        for pos in range(begin, end):
            previous = kv_entry(previous, tokens[pos])
            block = self.kv.setdefault(table[pos // bs], [None] * bs)
            block[pos % bs] = previous
        state.num_computed_tokens = end
        return previous


def _new_state(new: NewRequestData) -> _RequestState:
    return _RequestState(
        token_ids=list(new.token_ids),
        block_ids=list(new.block_ids),
        num_computed_tokens=new.num_computed_tokens,
        entries=[],
    )
