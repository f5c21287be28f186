"""A draft model (``method: draft``): a smaller checkpoint with the model's tokenizer, run on
rank 0 of the worker beside the model, proposing its greedy continuation.

The draft has its own paged KV cache, with the model's number of blocks and block size, and
writes it at the model's block ids: a request's positions are the same in both, so the draft
needs no block table of its own, and whatever the scheduler does to a request's blocks (grow
them, share a prefix-cache block, free them) holds for the draft's cache too. The block table
only changes wholesale when a request is resumed after a preemption, and the runner then calls
``forget``.

Per request the proposer keeps ``computed``: how many of its positions the draft's cache holds
(0 at first and after ``forget``). Each call runs, batched over the requests:

1. a catch-up forward over each request's tokens ``[computed, len)`` (its prompt on the first
   call, afterwards what the model emitted since), in chunks of at most
   ``max_num_batched_tokens`` tokens; the argmax at position ``len - 1`` is draft 1;
2. up to ``max_tokens - 1`` forwards of one token per request: draft ``j`` at position
   ``len - 1 + j`` gives draft ``j + 1`` (a request asking for fewer leaves the batch).

The drafts' own positions hold the right keys and values only if the model accepts them, so
``computed`` becomes ``len``: the next call recomputes from there (the accepted drafts and the
model's own token), never trusting a position the model may have rejected. A prefix-cache
block another request shares is written again with the same tokens, so the same values.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

import numpy as np

from ketch.engine.device import parse_device
from ketch.engine.models.attention import SequenceSpan
from ketch.engine.models.backend import build_model
from ketch.engine.models.forward import forward_rows
from ketch.engine.models.loader import load_weights
from ketch.engine.models.sharding import Shard
from ketch.engine.spec_decode.draft_checks import check_draft_model
from ketch.engine.spec_decode.proposer import DraftRequest, Proposer
from ketch.engine.worker.host_memory import release_freed_memory
from ketch.engine.worker.kv_cache import KVCache

if TYPE_CHECKING:
    from ketch.engine.worker.runner_config import RunnerConfig

logger = logging.getLogger(__name__)


class DraftProposer(Proposer):
    def __init__(self, config: RunnerConfig) -> None:
        spec = config.speculative
        if spec is None or spec.model is None:
            raise ValueError("speculative_config.model is required for method 'draft'")
        # The engine ran these checks already; a runner built on its own runs them here.
        path, mc = check_draft_model(
            spec.model,
            config.model_path,
            config.model_config,
            config.max_model_len,
            config.backend,
            gpu=parse_device(config.device).is_gpu,
        )
        self.config = config
        self.draft_config = mc
        self.block_size = config.block_size
        self.num_blocks = config.num_blocks
        self.chunk = max(1, config.max_num_batched_tokens)  # tokens per catch-up forward
        threads = config.num_threads or len(os.sched_getaffinity(0))
        shard = Shard.of(mc, 0, 1)
        weights = load_weights(path, mc, config.dtype, shard, "float32")
        self.model = build_model(
            config.backend,
            mc,
            weights,
            config.max_model_len,
            threads,
            shard=shard,
            group=None,
            dtype=config.dtype,
            quantization=config.quantization,
        )
        del weights
        release_freed_memory()
        self.kv_cache = KVCache.for_model(mc, config)
        self.computed: dict[str, int] = {}
        self.weight_bytes = self.model.weight_bytes()
        self.kv_cache_bytes = int(self.kv_cache.array.nbytes)
        self.num_forwards = 0  # forward passes run (tests, logs)
        logger.info(
            "draft model ready: %s (%s, %d layers, hidden %d) on the %s backend, weights %.1f "
            "MiB, KV cache %.1f MiB (%d blocks x %d tokens, %s; not part of --kv-cache-memory)",
            path,
            mc.architecture,
            mc.num_hidden_layers,
            mc.hidden_size,
            self.model.backend_name,
            self.weight_bytes / 2**20,
            self.kv_cache_bytes / 2**20,
            config.num_blocks,
            config.block_size,
            config.kv_cache_dtype,
        )

    def forget(self, request_id: str) -> None:
        self.computed.pop(request_id, None)

    def propose(self, requests: list[DraftRequest]) -> dict[str, list[int]]:
        requests = [r for r in requests if r.max_tokens > 0 and r.token_ids]
        if not requests:
            return {}
        drafts = self._catch_up(requests)
        for request in requests:
            self.computed[request.request_id] = len(request.token_ids)
        # Further drafts, one position per forward: draft j (at position len - 1 + j) gives j + 1.
        for j in range(1, max(r.max_tokens for r in requests)):
            active = [r for r in requests if r.max_tokens > j]
            entries = [
                (r.block_ids, [drafts[r.request_id][-1]], len(r.token_ids) - 1 + j, True)
                for r in active
            ]
            for request, token in zip(active, self._run(entries), strict=True):
                drafts[request.request_id].append(token)
        return drafts

    def _catch_up(self, requests: list[DraftRequest]) -> dict[str, list[int]]:
        """Each request's tokens from ``computed`` on through its last, in forwards of at most
        ``chunk`` tokens; per request, the draft's token after its last."""
        pending = []
        for request in requests:
            length = len(request.token_ids)
            # Never past the last token: its row gives the first draft (a request deferred by
            # its grammar comes back with the same tokens).
            begin = min(self.computed.get(request.request_id, 0), length - 1)
            pending.append((request, begin))
        pending.reverse()  # popped from the end, in the requests' order
        first: dict[str, list[int]] = {}
        while pending:
            entries, owners, room = [], [], self.chunk
            while pending and room > 0:
                request, begin = pending.pop()
                length = len(request.token_ids)
                n = min(length - begin, room)
                done = begin + n == length
                entries.append(
                    (request.block_ids, request.token_ids[begin : begin + n], begin, done)
                )
                if done:
                    owners.append(request.request_id)
                else:
                    pending.append((request, begin + n))
                room -= n
            for request_id, token in zip(owners, self._run(entries), strict=True):
                first[request_id] = [token]
        return first

    def _run(self, entries: list[tuple[list[int], list[int], int, bool]]) -> list[int]:
        """One forward of the draft over ``entries`` (block table, tokens, first position,
        whether its last row's argmax is wanted), as ``ModelRunner._forward`` runs the model;
        the argmax tokens wanted, in order."""
        total = sum(len(tokens) for _, tokens, _, _ in entries)
        input_ids = np.empty(total, dtype=np.int64)
        positions = np.empty(total, dtype=np.int64)
        spans, rows = [], []
        start = 0
        for block_ids, tokens, begin, wanted in entries:
            n = len(tokens)
            input_ids[start : start + n] = tokens
            positions[start : start + n] = np.arange(begin, begin + n)
            spans.append(SequenceSpan(start, n, begin + n, block_ids))
            if wanted:
                rows.append(start + n - 1)
            start += n
        logits = forward_rows(
            self.model,
            input_ids,
            positions,
            self.kv_cache.layers,
            spans,
            rows or [total - 1],
            self.block_size,
            self.num_blocks,
        )
        self.num_forwards += 1
        if not rows:
            return []
        return np.argmax(logits.numpy(), axis=-1).astype(np.int64).tolist()
