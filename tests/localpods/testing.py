"""What the rendered-pods tests share: the examples, and the reference outputs."""

from __future__ import annotations

from pathlib import Path

import yaml

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
TIME_SCALE = 0.2  # startup/readiness polling and preStop sleeps 5x faster than the manifests


def example(name: str) -> dict:
    return yaml.safe_load((EXAMPLES / name).read_text())


def reference_texts(llm, prompts: list[str], max_tokens: int) -> list[str]:
    """Greedy ``LLM.generate`` texts: what every served answer must equal."""
    from ketch.engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return [out.outputs[0].text for out in llm.generate(prompts, params)]
