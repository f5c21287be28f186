"""``method: mtp``: drafts with the multi-token-prediction layer the checkpoint carries (ERNIE
4.5 MoE's ``mtp_*`` weights), as transformers' ``MtpModel`` computes it.

The layer at position i takes the target's final-normed hidden state h_i and the token at i + 1,
and predicts the token at i + 2:

    x = eh_proj([enorm(embed(t_{i+1})), hnorm(h_i)])    (the embedding half first)
    y = final_norm(block(x))                            (a decoder layer of the model's kind)
    logits = lm_head(y)                     (embedding, final norm and lm_head: the target's)

``block`` attends over the layer's own KV cache (one layer, the target's block ids and block
size): row i's keys and values sit at slot i of the request's blocks and are rotated by position
i + 1 (the position of the token it embeds, as transformers passes position ids shifted by one).

The runner hands over each step's hidden states after verification (``observe``): the rows of
the positions that hold real tokens go through the layer at once, filling the cache, and the
last one's output (its normed state and its argmax) is kept. At the next step the request's last
token is at position n - 1 and the last row done is n - 2, whose argmax is the first draft
(token n). Further drafts chain the same layer on its own output, as transformers' multi-layer
loop chains its layers: row n - 1 + j takes y of the row before and draft j, at slot n - 1 + j
(rewritten with the real row once the target has computed that position). Drafts are argmaxes:
the verifier treats them as certain proposals (``spec_decode.verify``).

A request proposes only once every row from position 0 is in the cache: one whose earlier KV came
from elsewhere (a prefix-cache hit, a prefill peer) has no hidden states for those positions and
proposes nothing until it is forgotten (a preemption recomputes it from scratch).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import paddle
from paddle.nn.functional import embedding

from ketch.engine.models.attention import SequenceSpan
from ketch.engine.models.forward import forward_rows
from ketch.engine.models.llama import LlamaModel, ModelWeights
from ketch.engine.models.loader import load_mtp_weights, mtp_config
from ketch.engine.models.sharding import whole
from ketch.engine.spec_decode.proposer import DraftRequest, Proposer, StepHidden
from ketch.engine.worker.kv_cache import KVCache

if TYPE_CHECKING:
    from ketch.engine.models.protocol import DecoderModel
    from ketch.engine.worker.runner_config import RunnerConfig

logger = logging.getLogger(__name__)


@dataclass
class _Chain:
    """One request's MTP rows: 0..rows-1 are in the cache (row i at slot i)."""

    rows: int = 0
    last: np.ndarray | None = None  # the layer's normed output at row rows - 1
    draft: int = -1  # its argmax: the token at position rows + 1
    broken: bool = False  # positions without hidden states: never proposes


class MtpProposer(Proposer):
    wants_hidden = True

    def __init__(self, config: RunnerConfig, target: DecoderModel) -> None:
        from ketch.engine.models.llama_native import NativeLlamaModel

        mc = config.model_config
        if not mc.num_mtp_layers:
            raise ValueError(
                "speculative_config.method 'mtp' needs a checkpoint with multi-token-prediction "
                f"layers (config num_nextn_predict_layers > 0); {config.model_path} has none"
            )
        if not target.supports_mtp:
            raise ValueError(
                f"speculative_config.method 'mtp' runs with the native or eager backend, not "
                f"{target.backend_name}"
            )
        self.config = config
        self.eps = float(mc.rms_norm_eps)
        cfg = mtp_config(mc)
        loaded = load_mtp_weights(config.model_path, mc, config.dtype, "float32")
        self.enorm, self.hnorm, self.eh_proj = loaded.enorm, loaded.hnorm, loaded.eh_proj
        tw = target.weights
        self.embed = tw.embed
        self.kernels = target.kernels
        weights = ModelWeights(
            embed=tw.embed,
            layers=[loaded.layer],
            norm=tw.norm,  # transformers: the model's final norm is the layer's post-norm
            lm_head=tw.lm_head,
            lm_head_bias=tw.lm_head_bias,
        )
        eager = LlamaModel(cfg, weights, config.max_model_len, target.kernels)
        if isinstance(target, NativeLlamaModel):
            # The target's matmul, attention kernel and lm_head in its prepared layout: the
            # block's own weights are prepared here, the lm_head is shared as it is.
            weights = ModelWeights(tw.embed, [loaded.layer], tw.norm, None, None)
            self.block = NativeLlamaModel(
                cfg, weights, eager, target.linear, target.attention, whole(cfg), None,
                target.panels,
            )  # fmt: skip
            self.block.weights.lm_head = tw.lm_head
            self.block.weights.lm_head_bias = tw.lm_head_bias
        else:
            self.block = eager
        self.cache = KVCache.for_model(cfg, config, num_layers=1)
        self._chains: dict[str, _Chain] = {}
        logger.info(
            "speculative method mtp: the checkpoint's MTP layer (%s MLP), its own KV cache of "
            "%d blocks (%.1f MiB)",
            "routed-expert" if cfg.is_moe else "dense",
            config.num_blocks,
            self.cache.array.nbytes / 2**20,
        )

    # -- the runner's hooks --

    def observe(self, hidden: StepHidden, accepted: dict[str, int]) -> None:
        """Runs the layer on the rows of each request's real tokens (those whose next token is
        known), keeping the last row's output."""
        rows: list[tuple[str, int, np.ndarray, list[int], list[int]]] = []
        for request_id, (first, row, _count) in hidden.spans.items():
            chain = self._chains.setdefault(request_id, _Chain())
            if chain.broken:
                continue
            if first > chain.rows:  # earlier positions came without hidden states
                chain.broken, chain.last = True, None
                continue
            if first < chain.rows:  # recomputed: the rows from there are rewritten
                chain.rows, chain.last = first, None
            tokens = hidden.token_ids[request_id]
            n = min(accepted.get(request_id, 0), len(tokens) - 1 - first)
            if n <= 0:
                continue
            rows.append(
                (
                    request_id,
                    first,
                    hidden.rows[row : row + n],
                    tokens[first + 1 : first + 1 + n],
                    hidden.block_ids[request_id],
                )
            )
        if not rows:
            return
        logits, out = self._run(
            [(first, h, toks, blocks) for _, first, h, toks, blocks in rows],
        )
        drafts = logits.argmax(axis=-1)
        for i, (request_id, first, h, _toks, _blocks) in enumerate(rows):
            chain = self._chains[request_id]
            chain.rows = first + len(h)
            chain.last = out[i]
            chain.draft = int(drafts[i])

    def propose(self, requests: list[DraftRequest]) -> dict[str, list[int]]:
        drafts: dict[str, list[int]] = {}
        live = []  # (request, its chain's last output) of those drafting further
        for request in requests:
            chain = self._chains.get(request.request_id)
            n = len(request.token_ids)
            if chain is None or chain.broken or chain.last is None or chain.rows != n - 1:
                continue
            drafts[request.request_id] = [chain.draft]
            if request.max_tokens > 1:
                live.append((request, chain.last))
        step = 1
        while live:
            # Row n - 2 + step of each: its draft step - 1 and the row before's output.
            inputs = []
            for request, last in live:
                slot = len(request.token_ids) - 2 + step
                token = drafts[request.request_id][-1]
                inputs.append((slot, last[None, :], [token], request.block_ids))
            logits, out = self._run(inputs)
            chosen = logits.argmax(axis=-1)
            step += 1
            more = []
            for i, (request, _last) in enumerate(live):
                drafts[request.request_id].append(int(chosen[i]))
                if len(drafts[request.request_id]) < request.max_tokens:
                    more.append((request, out[i]))
            live = more
        return drafts

    def forget(self, request_id: str) -> None:
        self._chains.pop(request_id, None)

    # -- the layer --

    def _run(
        self, inputs: list[tuple[int, np.ndarray, list[int], list[int]]]
    ) -> tuple[np.ndarray, np.ndarray]:
        """Rows of the layer for each (first slot, target hidden rows [n, hidden], the tokens
        after them, block ids): (the logits, the normed outputs) of each input's last row."""
        spans, positions, token_ids, states, last_rows = [], [], [], [], []
        start = 0
        for first, h, tokens, block_ids in inputs:
            n = len(tokens)
            spans.append(SequenceSpan(start, n, first + n, block_ids))
            positions.extend(range(first + 1, first + 1 + n))  # the embedded tokens' positions
            token_ids.extend(tokens)
            states.append(np.asarray(h, dtype=np.float32))
            start += n
            last_rows.append(start - 1)
        ids = paddle.to_tensor(np.asarray(token_ids, dtype=np.int64))
        rms_norm = self.kernels.rms_norm
        e = embedding(ids, self.embed).astype("float32")
        h = paddle.to_tensor(np.concatenate(states))
        x = paddle.concat([rms_norm(e, self.enorm, self.eps), rms_norm(h, self.hnorm, self.eps)], 1)
        x = paddle.matmul(x, self.eh_proj)
        bs = self.config.block_size
        logits, out = forward_rows(
            self.block,
            ids,
            positions,
            self.cache.layers,
            spans,
            last_rows,
            bs,
            self.config.num_blocks,
            last_rows,
            inputs_embeds=x,
        )
        return logits.astype("float32").numpy(), out.astype("float32").numpy()
