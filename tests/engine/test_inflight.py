"""Requests in flight when ``sleep`` is called, under each mode (DESIGN §3 invariant 5)."""

from __future__ import annotations

from dormant import SamplingParams
from tests.engine.conftest import PROMPTS

PARAMS = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


def run_to_completion(engine, outputs):
    while engine.has_unfinished_requests():
        for output in engine.step():
            outputs[output.request_id] = output
    return outputs


def start(llm, num_steps: int = 4):
    engine = llm.llm_engine
    ids = [engine.add_request(p, PARAMS) for p in PROMPTS]
    outputs: dict[str, object] = {}
    for _ in range(num_steps):
        for output in engine.step():
            outputs[output.request_id] = output
    return engine, ids, outputs


def uninterrupted(make_llm, checkpoint) -> list[tuple[int, ...]]:
    llm = make_llm(str(checkpoint))
    outputs = llm.generate(PROMPTS, PARAMS)
    llm.shutdown()
    return [o.outputs[0].token_ids for o in outputs]


def test_abort_mode_finishes_in_flight_requests_as_aborted(make_llm, checkpoint) -> None:
    llm = make_llm(str(checkpoint))
    engine, ids, _ = start(llm)
    aborted = engine.sleep(level=1, mode="abort")
    assert sorted(o.request_id for o in aborted) == sorted(str(i) for i in ids)
    assert all(o.outputs[0].finish_reason == "abort" and o.finished for o in aborted)
    assert all(0 < len(o.outputs[0].token_ids) < 20 for o in aborted)  # partial outputs
    assert not engine.has_unfinished_requests()
    llm.wake_up()
    assert len(llm.generate(PROMPTS, PARAMS)) == len(PROMPTS)


def test_wait_mode_drains_before_sleeping(make_llm, checkpoint) -> None:
    expected = uninterrupted(make_llm, checkpoint)
    llm = make_llm(str(checkpoint))
    engine, ids, outputs = start(llm)
    for output in engine.sleep(level=1, mode="wait"):
        outputs[output.request_id] = output
    assert llm.is_sleeping() and not engine.has_unfinished_requests()
    assert [outputs[str(i)].outputs[0].token_ids for i in ids] == expected
    assert all(outputs[str(i)].outputs[0].finish_reason == "length" for i in ids)


def test_keep_mode_resumes_after_wake_with_the_same_tokens(make_llm, checkpoint) -> None:
    expected = uninterrupted(make_llm, checkpoint)
    llm = make_llm(str(checkpoint))
    engine, ids, outputs = start(llm)
    assert engine.sleep(level=1, mode="keep") == []
    assert engine.has_unfinished_requests()
    llm.wake_up()
    run_to_completion(engine, outputs)
    assert [outputs[str(i)].outputs[0].token_ids for i in ids] == expected


def test_keep_mode_through_level_2_and_a_refit(make_llm, checkpoint) -> None:
    expected = uninterrupted(make_llm, checkpoint)
    llm = make_llm(str(checkpoint))
    engine, ids, outputs = start(llm)
    engine.sleep(level=2, mode="keep")
    llm.wake_up(["weights"])
    llm.reload_weights()
    llm.wake_up(["kv_cache"])
    run_to_completion(engine, outputs)
    assert [outputs[str(i)].outputs[0].token_ids for i in ids] == expected


def test_an_output_lists_the_weight_versions_its_tokens_came_from(make_llm, checkpoint) -> None:
    """A request kept by pause(mode="keep") across a refit continues on the new weights, as in
    vLLM (OpenRLHF's partial rollouts rely on it); its output says so. One that ran on one set
    of weights lists one version."""
    llm = make_llm(str(checkpoint))
    engine, ids, outputs = start(llm)
    engine.pause("keep")
    engine.reload_weights(weight_version="v2")
    engine.resume()
    run_to_completion(engine, outputs)
    assert all(outputs[str(i)].weight_versions == ["default", "v2"] for i in ids)
    assert all(outputs[str(i)].weight_version == "v2" for i in ids)
    (after,) = llm.generate(PROMPTS[:1], PARAMS)
    assert after.weight_versions == ["v2"]
    engine.pause("keep")  # nothing in flight: a refit that names no version
    engine.reload_weights()
    engine.resume()
    kept, *_ = start(llm, num_steps=2)[1]
    engine.pause("keep")
    engine.reload_weights()
    engine.resume()
    run_to_completion(engine, outputs)
    assert outputs[str(kept)].weight_versions == ["v2", "v2"]  # two weight sets, one name
