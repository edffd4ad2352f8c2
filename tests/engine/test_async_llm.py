"""``AsyncLLM``: streams, cancellation, abort, the three pause modes, sleeps and refits that
land between two steps, and requests kept through a sleep that end as if undisturbed."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from safetensors.torch import load_file

from dormant import SamplingParams
from dormant.core.errors import EngineAsleepError
from dormant.engine.async_llm import AsyncLLM, RequestOutputKind
from tests.engine.conftest import write_checkpoint
from tests.server.tokenizer_files import write_tokenizer

OPTIONS = dict(
    device="cpu", max_model_len=256, max_num_seqs=8, kv_cache_memory_bytes=4 << 20, seed=0
)
PROMPTS = [[5 + i, 17, 99, 3 * i + 1, 250, 42][: 3 + i % 4] for i in range(8)]


def greedy(max_tokens: int = 24) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    dirs = []
    for seed in (1, 2):
        path = write_checkpoint(tmp_path_factory.mktemp(f"async_{seed}"), seed=seed)
        write_tokenizer(path)
        dirs.append(path)
    return dirs[0], dirs[1]


@pytest.fixture
def engine(model_dirs) -> Iterator[AsyncLLM]:
    engine = AsyncLLM(str(model_dirs[0]), enable_sleep_mode=True, **OPTIONS)
    yield engine
    engine.shutdown()


@pytest.fixture
def slow_steps(engine: AsyncLLM, monkeypatch) -> list[bool]:
    """Each step takes at least 5 ms (so a command reliably lands mid-request) and records
    whether the engine was asleep or paused when it started."""
    asleep_at_step: list[bool] = []
    step = engine.engine.step

    def slow_step():
        asleep_at_step.append(engine.engine.is_sleeping())
        time.sleep(0.005)
        return step()

    monkeypatch.setattr(engine.engine, "step", slow_step)
    return asleep_at_step


async def collect(engine: AsyncLLM, prompt, params, request_id: str):
    return [o async for o in engine.generate(prompt, params, request_id)]


async def first_tokens_then(engine: AsyncLLM, params: SamplingParams, prompts=PROMPTS):
    """Starts one stream per prompt; returns the tasks once every stream has a token."""
    started = [asyncio.Event() for _ in prompts]

    async def run(i: int, prompt):
        outputs = []
        async for output in engine.generate(prompt, params, f"r{i}"):
            outputs.append(output)
            started[i].set()
        started[i].set()
        return outputs

    tasks = [asyncio.create_task(run(i, p)) for i, p in enumerate(prompts)]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
    return tasks


def undisturbed(model_dir: Path, max_tokens: int) -> list[list[int]]:
    async def run() -> list[list[int]]:
        engine = AsyncLLM(str(model_dir), **OPTIONS)
        try:
            results = await asyncio.gather(
                *(collect(engine, p, greedy(max_tokens), f"u{i}") for i, p in enumerate(PROMPTS))
            )
        finally:
            engine.shutdown()
        return [list(r[-1].outputs[0].token_ids) for r in results]

    return asyncio.run(run())


def test_streams_are_cumulative_by_default_and_deltas_add_up(engine) -> None:
    async def run():
        cumulative = await collect(engine, PROMPTS[0], greedy(8), "a")
        deltas = [
            o
            async for o in engine.generate(
                PROMPTS[0], greedy(8), "b", output_kind=RequestOutputKind.DELTA
            )
        ]
        final = await collect_final(engine)
        return cumulative, deltas, final

    async def collect_final(engine):
        params = greedy(8)
        kind = RequestOutputKind.FINAL_ONLY
        return [o async for o in engine.generate(PROMPTS[0], params, "c", output_kind=kind)]

    cumulative, deltas, final = asyncio.run(run())
    whole = cumulative[-1].outputs[0]
    assert cumulative[-1].request_id == "a" and cumulative[-1].finished
    lengths = [len(o.outputs[0].token_ids) for o in cumulative]  # a step each, unless the
    assert lengths == sorted(set(lengths)) and lengths[-1] == 8  # reader fell behind (merged)
    assert [t for d in deltas for t in d.outputs[0].token_ids] == list(whole.token_ids)
    assert "".join(d.outputs[0].text for d in deltas) == whole.text
    assert len(final) == 1 and list(final[0].outputs[0].token_ids) == list(whole.token_ids)


def test_cancelling_the_consumer_aborts_the_request(engine, slow_steps) -> None:
    async def run():
        task = asyncio.create_task(collect(engine, PROMPTS[0], greedy(200), "x"))
        while not await engine.call(engine.engine.has_unfinished_requests):
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(500):
            if not await engine.call(engine.engine.has_unfinished_requests):
                return True
            await asyncio.sleep(0.01)
        return False

    assert asyncio.run(run()), "the cancelled request still runs in the engine"
    assert len(slow_steps) < 200


def test_closing_the_stream_aborts_the_request(engine, slow_steps) -> None:
    """``aclose`` on ``generate``'s generator (what ``break`` leads to) aborts the request:
    it stops in the engine long before its 200 tokens."""

    async def run() -> tuple[bool, bool]:
        stream = engine.generate(PROMPTS[0], greedy(200), "closed")
        first = await anext(stream)
        await stream.aclose()
        for _ in range(500):
            if not await engine.call(engine.engine.has_unfinished_requests):
                return first.finished, True
            await asyncio.sleep(0.01)
        return first.finished, False

    was_finished, is_stopped = asyncio.run(run())
    assert not was_finished and is_stopped, "the closed stream's request still runs"
    assert engine.num_requests == 0
    assert len(slow_steps) < 200


def test_abort_ends_the_stream_with_an_aborted_output(engine, slow_steps) -> None:
    async def run():
        (task,) = await first_tokens_then(engine, greedy(200), PROMPTS[:1])
        await engine.abort("r0")
        return await asyncio.wait_for(task, 60)

    outputs = asyncio.run(run())
    final = outputs[-1].outputs[0]
    assert outputs[-1].finished and final.finish_reason == "abort"
    assert 0 < len(final.token_ids) < 200


def test_pause_abort_finishes_running_requests(engine, slow_steps) -> None:
    async def run():
        tasks = await first_tokens_then(engine, greedy(200), PROMPTS[:3])
        await engine.pause_generation(mode="abort")
        results = await asyncio.wait_for(asyncio.gather(*tasks), 60)
        await engine.resume_generation()
        return results

    for outputs in asyncio.run(run()):
        assert outputs[-1].outputs[0].finish_reason == "abort"


def test_pause_wait_drains_then_new_requests_wait_for_resume(engine, model_dirs) -> None:
    expected = undisturbed(model_dirs[0], 24)

    async def run():
        tasks = await first_tokens_then(engine, greedy(24))
        await engine.pause_generation(mode="wait")
        assert all(t.done() for t in tasks)  # drained before the pause returned
        late = asyncio.create_task(collect(engine, PROMPTS[0], greedy(4), "late"))
        await asyncio.sleep(0.2)
        assert not late.done()  # paused: it waits
        await engine.resume_generation()
        return [await t for t in tasks], await asyncio.wait_for(late, 60)

    results, late = asyncio.run(run())
    assert [list(r[-1].outputs[0].token_ids) for r in results] == expected
    assert late[-1].outputs[0].finish_reason == "length"


def test_pause_keep_freezes_and_resume_continues_unchanged(engine, model_dirs, slow_steps) -> None:
    expected = undisturbed(model_dirs[0], 24)

    async def run():
        tasks = await first_tokens_then(engine, greedy(24))
        await engine.pause_generation(mode="keep")
        num_steps = len(slow_steps)
        await asyncio.sleep(0.2)
        assert len(slow_steps) == num_steps and not any(t.done() for t in tasks)
        await engine.resume_generation()
        return await asyncio.wait_for(asyncio.gather(*tasks), 60)

    results = asyncio.run(run())
    assert [list(r[-1].outputs[0].token_ids) for r in results] == expected


@pytest.mark.parametrize("how", ["sleep(1, keep)", "release(kv_cache)"])
def test_sleep_keep_with_8_requests_resumes_them_as_if_undisturbed(
    engine, model_dirs, slow_steps, how
) -> None:
    """The loop never steps an asleep engine (a queued sleep used to be followed by a step,
    which failed every request); the kept requests recompute their KV after the wake."""
    expected = undisturbed(model_dirs[0], 32)

    async def run():
        tasks = await first_tokens_then(engine, greedy(32))
        if how == "sleep(1, keep)":
            await engine.sleep(level=1, mode="keep")
        else:
            await engine.release(["kv_cache"])
        assert await engine.is_sleeping()
        assert not any(t.done() for t in tasks)
        with pytest.raises(EngineAsleepError):  # new requests are refused while asleep
            await collect(engine, PROMPTS[0], greedy(4), "new")
        assert await engine.wake_up() is True
        return await asyncio.wait_for(asyncio.gather(*tasks), 60)

    results = asyncio.run(run())
    assert [list(r[-1].outputs[0].token_ids) for r in results] == expected
    assert not any(slow_steps), "a step ran while the engine slept"


def test_sleeps_from_many_tasks_land_between_steps(engine, slow_steps) -> None:
    async def run():
        tasks = await first_tokens_then(engine, greedy(64))
        for _ in range(5):
            await asyncio.gather(engine.sleep(1, "keep"), engine.sleep(1, "keep"))
            await engine.wake_up()
        return await asyncio.wait_for(asyncio.gather(*tasks), 60)

    results = asyncio.run(run())
    assert all(r[-1].outputs[0].finish_reason == "length" for r in results)
    assert not any(slow_steps)


def test_a_refit_waits_for_running_requests_by_default(engine, model_dirs, slow_steps) -> None:
    """A completion never mixes weight versions: the running requests finish on the old
    weights, and requests after the refit run on the new ones."""
    old = undisturbed(model_dirs[0], 24)
    new = undisturbed(model_dirs[1], 24)
    weights = load_file(str(model_dirs[1] / "model.safetensors"))

    async def run():
        tasks = await first_tokens_then(engine, greedy(24))
        await engine.update_weights(weights, weight_version="v2")
        assert all(t.done() for t in tasks)
        after = await asyncio.gather(
            *(collect(engine, p, greedy(24), f"n{i}") for i, p in enumerate(PROMPTS))
        )
        return await asyncio.gather(*tasks), after

    before, after = asyncio.run(run())
    assert [list(r[-1].outputs[0].token_ids) for r in before] == old
    assert [list(r[-1].outputs[0].token_ids) for r in after] == new != old
    assert engine.weight_version == "v2"
    assert {o.weight_version for r in before for o in r} == {"default"}  # what made them
    assert {r[-1].weight_version for r in after} == {"v2"}


def test_a_refit_with_the_abort_policy_aborts_running_requests(engine, model_dirs, slow_steps):
    weights = load_file(str(model_dirs[1] / "model.safetensors"))

    async def run():
        tasks = await first_tokens_then(engine, greedy(200), PROMPTS[:2])
        await engine.update_weights(weights, policy="abort")
        return await asyncio.wait_for(asyncio.gather(*tasks), 60)

    for outputs in asyncio.run(run()):
        assert outputs[-1].outputs[0].finish_reason == "abort"


def test_a_refit_aborts_requests_kept_through_a_sleep(engine, model_dirs, slow_steps) -> None:
    """Kept requests with tokens cannot be drained; resuming them on new weights would mix
    versions, so the refit aborts them."""

    async def run():
        tasks = await first_tokens_then(engine, greedy(200), PROMPTS[:2])
        await engine.sleep(level=2, mode="keep")
        await engine.wake_up(["weights"])
        await engine.reload_weights(str(model_dirs[1]))
        await engine.wake_up()
        return await asyncio.wait_for(asyncio.gather(*tasks), 60)

    for outputs in asyncio.run(run()):
        assert outputs[-1].outputs[0].finish_reason == "abort"


def test_from_engine_args_and_collective_rpc(model_dirs) -> None:
    engine = AsyncLLM.from_engine_args({"model": str(model_dirs[0]), **OPTIONS})

    async def run():
        (status,) = await engine.collective_rpc("memory_status")
        health = await engine.collective_rpc("check_health")
        return status, health, await engine.reset_prefix_cache()

    try:
        status, health, reset = asyncio.run(run())
    finally:
        engine.shutdown()
    assert status.tags and health == [True] and reset is True
    with pytest.raises(TypeError, match="needs a model"):
        AsyncLLM.from_engine_args({})


def test_after_shutdown_calls_raise(model_dirs) -> None:
    from dormant.core.errors import EngineDeadError

    engine = AsyncLLM(str(model_dirs[0]), **OPTIONS)
    engine.shutdown()
    with pytest.raises(EngineDeadError):
        asyncio.run(engine.is_sleeping())


def test_output_kind_comes_from_the_sampling_params(engine) -> None:
    params = greedy(6)
    params.output_kind = RequestOutputKind.DELTA
    outputs = asyncio.run(collect(engine, PROMPTS[0], params, "k"))
    lengths = [len(o.outputs[0].token_ids) for o in outputs]  # deltas: one token a step, or
    assert sum(lengths) == 6 and min(lengths) >= 1  # several once a slow reader's were merged


def test_an_id_is_free_again_once_its_request_was_aborted(engine, slow_steps) -> None:
    """Regression: aborting a running request (closing its stream) or an id that was never
    added marked the id cancelled for good, so the next request by that id raised
    CancelledError, and the set of cancelled ids grew with every abort."""

    async def run() -> tuple[str | None, str | None]:
        stream = engine.generate(PROMPTS[0], greedy(200), "again")
        await anext(stream)
        await stream.aclose()
        await engine.abort("never-added")
        while await engine.call(engine.engine.has_unfinished_requests):
            await asyncio.sleep(0.01)
        reused = await collect(engine, PROMPTS[0], greedy(4), "again")
        fresh = await collect(engine, PROMPTS[0], greedy(4), "never-added")
        return reused[-1].outputs[0].finish_reason, fresh[-1].outputs[0].finish_reason

    assert asyncio.run(run()) == ("length", "length")
    assert not engine._requests._pending and not engine._requests._tracked


def test_a_held_request_aborted_before_its_add_is_never_added(engine, slow_steps) -> None:
    """A request that arrives while a ``wait`` pause drains is held behind the gate; aborted
    there, it is dropped when the gate opens, and its id is free afterwards."""

    async def run() -> tuple[int, str | None]:
        (running,) = await first_tokens_then(engine, greedy(16), PROMPTS[:1])
        pause = asyncio.create_task(engine.pause_generation(mode="wait"))
        while not engine._engine_loop.num_held and not pause.done():
            held = asyncio.create_task(collect(engine, PROMPTS[1], greedy(4), "held"))
            await asyncio.sleep(0.05)
            if not engine._engine_loop.num_held:
                held.cancel()
        assert not pause.done() and engine._engine_loop.num_held == 1
        held.cancel()
        await pause  # the drain ends: the gate opens and the held add runs, cancelled
        await engine.resume_generation()
        await running
        num_left = await engine.call(lambda: len(engine._requests._user_ids))
        again = await collect(engine, PROMPTS[1], greedy(4), "held")
        return num_left, again[-1].outputs[0].finish_reason

    assert asyncio.run(run()) == (0, "length")
    assert not engine._requests._pending and not engine._requests._tracked
