"""What the tensor-parallel ranks of one engine agree on each step.

Every rank receives the same step from the engine and keeps the same copy of every request, so
the batch each builds is the same, and the row-parallel all-reduces line up. Two things only
rank 0 knows, and it broadcasts them (``ShmGroup.broadcast_bytes``):

- before the forward, which new requests it could not take (a request another rank took would
  shift that rank's batch: the ranks must drop the same ones);
- after the forward, the tokens it sampled (the other ranks append them, so the next step's
  inputs agree), the requests that failed at sampling (a grammar that did not compile) and
  those it deferred (a grammar still compiling: every rank computes their last position again).

A rank that failed a request rank 0 took cannot follow the batch: it raises, its process exits,
and the engine fails the instance (``RemoteRunner`` watches every rank).
"""

from __future__ import annotations

import json

from ketch.engine.core.scheduler_output import ModelRunnerOutput
from ketch.kernels.collective import Group


class RankMismatchError(RuntimeError):
    """This rank's view of the step differs from rank 0's in a way it cannot repair."""


class StepSync:
    """One rank's side of the per-step agreement."""

    def __init__(self, group: Group) -> None:
        self.group = group
        self.first = group.rank == 0

    def agree_failed(self, failed: dict[str, str], drop) -> dict[str, str]:
        """Rank 0's failures become everyone's: returns them; ``drop(request_id)`` forgets a
        request this rank had taken."""
        if self.first:
            self.group.broadcast_bytes(json.dumps(failed).encode())
            return failed
        theirs = json.loads(self.group.broadcast_bytes(None))
        extra = set(failed) - set(theirs)
        if extra:
            request_id = sorted(extra)[0]
            raise RankMismatchError(
                f"rank {self.group.rank} could not take request {request_id} that rank 0 took: "
                f"{failed[request_id]}"
            )
        for request_id in theirs:
            if request_id not in failed:
                drop(request_id)
        return theirs

    def share(self, output: ModelRunnerOutput, before: set[str]) -> None:
        """Rank 0: the sampled tokens, the failures added since ``before`` and the deferred."""
        failed = {r: why for r, why in output.failed.items() if r not in before}
        message = {
            "ids": output.request_ids,
            "tokens": output.sampled_token_ids,
            "failed": failed,
            "deferred": output.deferred,
            "extra": output.extra_token_ids,
        }
        self.group.broadcast_bytes(json.dumps(message).encode())

    def follow(self) -> tuple[list[str], list[int], list[str], list[str], dict[str, list[int]]]:
        """The other ranks: (sampled request ids, their tokens, requests that failed, requests
        deferred, and per request the tokens it emitted after its first: speculative decoding's
        drafts kept and the token after them)."""
        message = json.loads(self.group.broadcast_bytes(None))
        return (
            message["ids"],
            message["tokens"],
            list(message["failed"]),
            message["deferred"],
            message["extra"],
        )

    def share_drafts(self, drafts: dict[str, list[int]]) -> dict[str, list[int]]:
        """Speculative decoding: rank 0's drafts, which every rank computes this step."""
        if self.first:
            self.group.broadcast_bytes(json.dumps(drafts).encode())
            return drafts
        return json.loads(self.group.broadcast_bytes(None))
