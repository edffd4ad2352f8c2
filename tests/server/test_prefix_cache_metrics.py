"""/metrics reports the engine's prefix cache: hits of a repeated prompt, cached blocks, and the
engine's own reset when a sleep discards the KV cache."""

from __future__ import annotations

import re

from tests.server.conftest import GREEDY

PROMPT = list(range(40, 80))  # 40 tokens: 2 full blocks of 16, and 8 more


def quantity(text: str, name: str) -> float:
    match = re.search(rf'dormant_prefix_cache{{model_name="tiny",quantity="{name}"}} (\S+)', text)
    assert match, f"no prefix-cache {name} in /metrics"
    return float(match.group(1))


def test_metrics_report_the_prefix_cache(server) -> None:
    body = {"model": "tiny", "prompt": PROMPT, **GREEDY}
    for _ in range(2):
        assert server.post("/v1/completions", body).status_code == 200
    text = server.get("/metrics").text
    assert quantity(text, "query_tokens") == 80 and quantity(text, "hit_tokens") == 32
    assert quantity(text, "hit_rate") == 32 / 80
    assert quantity(text, "cached_blocks") == 3  # 40 + 12 tokens, 51 computed
    assert quantity(text, "resets") == 0
    assert server.post("/sleep?level=1").status_code == 200
    text = server.get("/metrics").text
    assert quantity(text, "cached_blocks") == 0 and quantity(text, "resets") == 1
