"""A running sequence whose KV memory the caller's own code discarded (``collective_rpc`` with
a callable that sleeps and wakes its worker: the engine did not make that sleep, so it settled
nothing first) is preempted before the next step and recomputes its KV. It went on decoding
over the zeroed KV before, and its tokens silently changed (``engine/kv_epoch.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dormant import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPT = list(range(1, 30))


def sleep_and_wake(worker) -> int:
    worker.sleep(1)  # level 1 discards the KV cache
    worker.wake_up()
    return worker.num_kv_discards


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_callers_kv_discard_makes_running_sequences_recompute(
    make_llm, checkpoint: Path, async_scheduling: bool
) -> None:
    options = dict(enable_sleep_mode=True, async_scheduling=async_scheduling)
    llm = make_llm(str(checkpoint), **options)
    expected = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    engine = llm.llm_engine
    engine.add_request({"prompt_token_ids": PROMPT}, GREEDY)
    for _ in range(4):  # the prefill and some decodes
        engine.step()
    assert engine.collective_rpc(sleep_and_wake) == [1]
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    (output,) = outputs
    assert output.outputs[0].token_ids == expected
