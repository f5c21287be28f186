"""The architectures Ketch serves, and for each the ``config.json`` fields it checks at load.

One table. An architecture's entry says which weights its decoder layers have (biases, per-head
q/k norms), the defaults its Hugging Face config class gives fields that ``config.json`` may
leave out, each layer's sliding window as its modeling code applies it (``windows``), and the
rules for the fields whose values Ketch implements only in part. A value that would make the
model compute something other than transformers does is refused at load, in an error naming the
field: never served silently different. Fields transformers' modeling code ignores for an
architecture (e.g. ``attention_bias`` for Mistral) are ignored here too, except attention that
is not full (a sliding window, other ``layer_types``): a config that declares it was likely
trained with it, so it is refused where transformers would ignore it (a window on Llama,
``layer_types`` on Llama, Mistral and Qwen3-MoE).

``SUPPORTED_ARCHITECTURES`` is the one list of what Ketch serves (the CLI's errors, the operator
and docs/models.md follow it). ``rules`` holds what an entry is and the rules several families
share; each family has its module (``llama``, ``qwen``, ``ernie``, ``gemma3``). This package
imports nothing heavy: no paddle.
"""

from __future__ import annotations

from ketch.engine.models.architectures.ernie import ERNIE4_5, ERNIE4_5_MOE
from ketch.engine.models.architectures.gemma3 import (
    GEMMA3,
    gemma3_layer_types,
    gemma3_rope_parameters,
)
from ketch.engine.models.architectures.llama import LLAMA, MISTRAL
from ketch.engine.models.architectures.qwen import QWEN2, QWEN3, QWEN3_MOE
from ketch.engine.models.architectures.rules import Architecture, Experts, Settings, rope_field

__all__ = [
    "ARCHITECTURES",
    "SUPPORTED_ARCHITECTURES",
    "Architecture",
    "Experts",
    "Settings",
    "gemma3_layer_types",
    "gemma3_rope_parameters",
    "rope_field",
]

ARCHITECTURES: dict[str, Architecture] = {
    a.name: a for a in (LLAMA, MISTRAL, QWEN2, QWEN3, QWEN3_MOE, ERNIE4_5, ERNIE4_5_MOE, GEMMA3)
}
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(ARCHITECTURES)
