"""What the model runner and the proposers ask of a model: ``DecoderModel``.

Every model class (``LlamaModel`` and ``Gemma3Model``, ``NativeLlamaModel`` and
``NativeGemma3Model``, ``PredictorLlamaModel``, ``GpuLlamaModel``) has each of these, so no
caller asks a model what it has. What a backend cannot do it says: ``kept_rows`` returns None
where the backend computes every row of its last layer, ``supports_mtp`` is False where the MTP
proposer cannot build its layer on the model's weights and kernels.

A leaf module: it imports nothing of the engine, so any module may name the protocol.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar, Protocol


class DecoderModel(Protocol):
    """A decoder over the paged KV cache, computing logits for chosen rows of a flat batch."""

    backend_name: ClassVar[str]
    """The backend's name, as ``--backend`` spells it (``eager``, ``native``, ...)."""

    supports_mtp: ClassVar[bool]
    """Whether ``spec_decode.mtp`` may run the checkpoint's MTP layer beside this model (on its
    weights, kernels and matmul); when False it refuses the method with the backend's name."""

    def metadata(self, spans: Sequence[Any], block_size: int, num_blocks: int) -> Any:
        """The attention inputs ``forward`` needs for a step of ``spans`` (``SequenceSpan``)."""
        ...

    def kept_rows(
        self,
        spans: Sequence[Any],
        logit_rows: Sequence[int],
        hidden_rows: Sequence[int] | None,
        block_size: int,
    ) -> Any | None:
        """The rows the last layer must compute past its K/V write, for ``forward``'s ``kept``;
        None when it computes them all (always, for a backend that cannot prune rows)."""
        ...

    def forward(
        self,
        input_ids: Any,
        positions: Any,
        kv_caches: list,
        meta: Any,
        logit_rows: Any,
        hidden_rows: Any | None = None,
    ) -> Any:
        """Logits [len(logit_rows), vocab] in float32; with ``hidden_rows``, (logits, those
        rows' final-normed hidden states); None on a tensor-parallel rank other than 0. More
        keyword inputs only where the model said it takes them: ``kept`` (a ``kept_rows``
        answer that is not None), ``inputs_embeds`` (``supports_mtp``)."""
        ...

    def weight_bytes(self) -> int:
        """Bytes of the weights this model holds, in the layouts it computes from."""
        ...
