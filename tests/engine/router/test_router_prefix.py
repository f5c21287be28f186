"""Prefix-aware routing, seen through the instances' own prefix-cache metrics.

Three groups of prompts, each sharing a long prefix (many KV blocks of 16 tokens), are sent
interleaved. Under prefix-hash every group lands on one instance and its later requests hit
that instance's prefix cache; under round-robin each group is spread over several instances,
each of which has to prefill the prefix once.
"""

from __future__ import annotations

import random

import httpx
import pytest
from router_harness import Router, running_router
from serve_harness import Server, metric, scrape

WORDS = [
    "alice",
    "rabbit",
    "queen",
    "hatter",
    "dodo",
    "turtle",
    "garden",
    "tea",
    "croquet",
    "caterpillar",
    "mushroom",
]
PER_GROUP = 5


def prefix_hits(instances: list[Server]) -> float:
    return sum(metric(scrape(s.url), "prefix_cache_token_num") for s in instances)


def send_groups(router: Router, instances: list[Server], seed: int) -> tuple[list[set], float]:
    """Sends 3 groups x PER_GROUP prompts; returns each group's instances and the hit tokens."""
    rng = random.Random(seed)
    prefixes = [" ".join(rng.choice(WORDS) for _ in range(120)) for _ in range(3)]
    hits_before = prefix_hits(instances)
    landed: list[set] = [set(), set(), set()]
    for i in range(3 * PER_GROUP):
        group = (i // 2) % 3  # g0 g0 g1 g1 g2 g2 g0 ...: not aligned with a 3-way rotation
        before = router.request_counts()
        body = {"model": "tiny", "prompt": f"{prefixes[group]} question {i}?", "max_tokens": 2}
        reply = httpx.post(f"{router.url}/v1/completions", json=body, timeout=30)
        assert reply.status_code == 200, reply.text
        after = router.request_counts()
        (target,) = [url for url in after if after[url] != before.get(url, 0)]
        landed[group].add(target)
    return landed, prefix_hits(instances) - hits_before


def route(instances: list[Server], policy: str, seed: int) -> tuple[list[set], float, str]:
    mixed = ",".join(s.url for s in instances)
    with running_router("--mixed", mixed, "--policy", policy) as r:
        landed, hits = send_groups(r, instances, seed)
        metrics = httpx.get(f"{r.url}/metrics", timeout=5).text
    return landed, hits, metrics


@pytest.mark.timeout(120)
def test_prefix_hash_keeps_each_prefix_on_one_instance(instances: list[Server]) -> None:
    landed, hits, metrics = route(instances, "prefix-hash", seed=1)
    assert all(len(group) == 1 for group in landed), landed
    assert "ketch_router_prefix_matches_total 12.0" in metrics  # all but each group's first

    rr_landed, rr_hits, _ = route(instances, "round-robin", seed=2)
    assert all(len(group) >= 2 for group in rr_landed), rr_landed
    # Each group prefills its ~100-token prefix once under prefix-hash, 2-3 times under
    # round-robin, so prefix-hash serves more prompt tokens from the cache.
    assert hits > rr_hits > 0, (hits, rr_hits)
