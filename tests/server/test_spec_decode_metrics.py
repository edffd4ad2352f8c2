"""/metrics reports speculative decoding's counters (vLLM's ``spec_decode_*``, dormant's
prefix), read from the engine at scrape time; ``memory_status()`` carries the same counts."""

from __future__ import annotations

import re

from tests.server.conftest import GREEDY


def counter(text: str, name: str, position: int | None = None) -> float:
    labels = 'model_name="tiny"' + ("" if position is None else f',position="{position}"')
    match = re.search(rf"dormant_spec_decode_{name}_total{{{labels}}} (\S+)", text)
    assert match, f"no dormant_spec_decode_{name} in /metrics"
    return float(match.group(1))


def test_metrics_report_speculative_decoding(start_server, model_dir) -> None:
    spec = {"model": str(model_dir), "num_speculative_tokens": 2}  # self-speculation
    server = start_server(engine_options={"speculative_config": spec})
    body = {"model": "tiny", "prompt": list(range(40, 50)), **GREEDY}
    assert server.post("/v1/completions", body).status_code == 200
    text = server.get("/metrics").text
    drafts, proposed = counter(text, "num_drafts"), counter(text, "num_draft_tokens")
    assert drafts > 0 and proposed >= drafts
    assert counter(text, "num_accepted_tokens") == proposed  # every self-draft is accepted
    assert counter(text, "num_accepted_tokens_per_pos", 0) == drafts
    status = server.engine.engine.memory_status()[0]
    assert status.spec_decode is not None and status.spec_decode.num_drafts == drafts
    assert "speculative decoding" in status.table()


def test_no_spec_decode_metrics_without_speculation(server) -> None:
    assert "dormant_spec_decode" not in server.get("/metrics").text
