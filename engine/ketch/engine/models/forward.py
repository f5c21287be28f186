"""One forward pass of a model over a step's flat rows: what the model runner and the proposers
that run a model of their own (a draft model, an MTP layer) all do the same way."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import paddle

from ketch.engine.models.attention import SequenceSpan

if TYPE_CHECKING:
    from ketch.engine.models.protocol import DecoderModel


def forward_rows(
    model: DecoderModel,
    input_ids: np.ndarray | paddle.Tensor,
    positions: np.ndarray | Sequence[int],
    kv_layers: list,
    spans: list[SequenceSpan],
    logit_rows: Sequence[int],
    block_size: int,
    num_blocks: int,
    hidden_rows: Sequence[int] | None = None,
    **inputs: Any,
) -> Any:
    """``model.forward`` over ``spans`` (attention metadata from them, the native model's last
    layer only on the rows read): the logits of ``logit_rows``, and with ``hidden_rows`` the pair
    (logits, those rows' final hidden states); None on a tensor-parallel rank other than 0.
    ``inputs``: more of the model's forward arguments (``inputs_embeds``)."""
    meta = model.metadata(spans, block_size, num_blocks)
    if hidden_rows is not None:  # only then: the models' forward returns a pair
        inputs["hidden_rows"] = paddle.to_tensor(np.asarray(hidden_rows, np.int64))
    kept = model.kept_rows(spans, list(logit_rows), hidden_rows, block_size)
    if kept is not None:  # the native model: its last layer on the rows read
        inputs["kept"] = kept
    if not isinstance(input_ids, paddle.Tensor):
        input_ids = paddle.to_tensor(np.asarray(input_ids, dtype=np.int64))
    with paddle.no_grad():
        return model.forward(
            input_ids,
            paddle.to_tensor(np.asarray(positions, dtype=np.int64)),
            kv_layers,
            meta,
            paddle.to_tensor(np.asarray(logit_rows, dtype=np.int64)),
            **inputs,
        )
