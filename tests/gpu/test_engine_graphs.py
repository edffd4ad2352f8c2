"""The prior art's lifecycle on the GPU with CUDA graphs (FULL and fused multi-step): tokens
identical, layout pointers unchanged, no recapture; a soak; the residual while asleep."""

from __future__ import annotations

import random

import psutil
import pytest
import torch

from dormant import LLM, SamplingParams
from dormant.core.step_input import StepInput
from dormant.engine.batch import ScheduledBatch
from dormant.worker.pending_step import PendingStep
from tests.engine.conftest import PROMPTS, write_checkpoint
from tests.gpu.conftest import make_engine

pytestmark = pytest.mark.gpu
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=16, ignore_eos=True)
MiB = 1 << 20


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory):
    return write_checkpoint(tmp_path_factory.mktemp("graph_ckpt"), seed=1)


def tokens(llm: LLM, params: SamplingParams = GREEDY) -> list[tuple[int, ...]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]


def graph_visible(llm: LLM) -> list[tuple[int, int]]:
    """(id, address) of every tensor a captured graph reads or writes outside its own pool."""
    worker = llm.llm_engine.executor.worker
    graphs = worker.runner.graphs
    tensors = [*worker.runner.inputs.tensors()]
    tensors += [a.kv_cache for a in worker.model.attention_layers()]
    tensors += [a.k_scale for a in worker.model.attention_layers()]
    tensors += [g.output for g in (*graphs.full.values(), *graphs.multi_step.values())]
    return [(id(t), t.data_ptr()) for t in tensors]


def multi_step_tokens(llm: LLM) -> list[list[int]]:
    """Prefill through the engine, then one replay of the fused multi-step graph."""
    engine = llm.llm_engine
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS]
    engine.step()  # the prefill: KV for every prompt, one token each
    running = [engine.scheduler._unfinished_by_id[i] for i in ids]
    step = ScheduledBatch.of([(seq, 1) for seq in running]).step_input(engine.runtime.eos_token_ids)
    result = engine.executor.worker.execute_multi_step(step).seqs
    engine.abort_request(ids)
    return [
        [seq.output_token_ids[0], *out.token_ids] for seq, out in zip(running, result, strict=True)
    ]


def cycle(llm: LLM, level: int) -> None:
    """generate → sleep(level) → wake weights → (refit) → wake KV, as the prior art ran it."""
    llm.sleep(level=level)
    llm.wake_up(["weights"])
    if level == 2:
        llm.collective_rpc("reload_weights")
    llm.wake_up(["kv_cache"])


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("poison", [False, True])
@pytest.mark.parametrize("level", [1, 2])
def test_lifecycle_with_full_and_multi_step_graphs(
    engines, checkpoint, kv_cache_dtype, poison, level
) -> None:
    llm = make_engine(
        engines, checkpoint, dtype="bfloat16", kv_cache_dtype=kv_cache_dtype, memory_poison=poison
    )
    assert llm.llm_engine.executor.worker.runner.graphs is not None
    full, seeded, multi = tokens(llm), tokens(llm, SEEDED), multi_step_tokens(llm)
    assert [list(t[:5]) for t in full] == multi  # the fused graph decodes what single steps do
    pointers = graph_visible(llm)
    for _ in range(2):
        cycle(llm, level)
        assert graph_visible(llm) == pointers  # same objects at the same addresses
        assert tokens(llm) == full and tokens(llm, SEEDED) == seeded
        assert multi_step_tokens(llm) == multi
    llm.collective_rpc("verify_guards")


def test_greedy_decodes_run_through_the_multi_step_graph(engines, checkpoint) -> None:
    """The scheduler hands greedy decode batches to the fused graph, 4 steps per replay; the
    tokens equal those of an engine that runs one FULL graph per step."""
    llm = make_engine(engines, checkpoint)
    executor = llm.llm_engine.executor
    replays: list[int] = []
    launch = executor.launch  # every call the engine makes (UniprocExecutor)

    def counted(step: StepInput, multi_step: bool = False) -> PendingStep:
        if multi_step:
            replays.append(len(step.seqs))
        return launch(step, multi_step)

    executor.launch = counted  # type: ignore[method-assign]
    multi = tokens(llm)
    assert replays == [len(PROMPTS)] * 3  # 1 prefill token, 3 x 4 fused, then 3 single steps
    engines.pop().shutdown()  # one engine per GPU at a time
    assert multi == tokens(make_engine(engines, checkpoint, cuda_graph_multi_steps=1))


def test_graphs_decode_what_eager_decodes(engines, checkpoint) -> None:
    graphs = tokens(make_engine(engines, checkpoint))
    engines.pop().shutdown()
    eager = tokens(make_engine(engines, checkpoint, enforce_eager=True))
    assert graphs == eager


def test_soak_200_cycles(engines, checkpoint) -> None:
    llm = make_engine(engines, checkpoint, memory_poison=True)
    expected = tokens(llm)
    rng = random.Random(0)
    process = psutil.Process()
    samples = []
    for i in range(200):
        level = rng.choice([1, 2])
        llm.sleep(level=level)
        order = rng.choice([["weights", "kv_cache"], ["kv_cache", "weights"], None])
        for tag in order or [None]:
            llm.wake_up([tag] if tag else None)
            if level == 2 and tag in ("weights", None):
                llm.reload_weights()
        assert tokens(llm) == expected, f"cycle {i}"
        if i in (9, 199):
            free, _ = torch.cuda.mem_get_info()
            samples.append((free, process.memory_info().rss))
    (free10, rss10), (free200, rss200) = samples
    drift_device, drift_rss = free10 - free200, rss200 - rss10
    print(
        f"soak: device memory drift {drift_device / MiB:+.1f} MiB, host RSS drift "
        f"{drift_rss / MiB:+.1f} MiB over cycles 10..200"
    )
    assert abs(drift_device) < 64 * MiB and drift_rss < 256 * MiB


def test_residual_while_fully_asleep(engines, checkpoint) -> None:
    torch.cuda.empty_cache()
    free_before, _ = torch.cuda.mem_get_info()
    llm = make_engine(engines, checkpoint, dtype="bfloat16")
    tokens(llm)
    llm.sleep(level=2)
    free_asleep, _ = torch.cuda.mem_get_info()
    status = llm.memory_status()[0]
    print(status.table())
    residual = free_before - free_asleep
    print(f"residual beyond the CUDA context while fully asleep: {residual / MiB:.1f} MiB")
    assert residual <= 256 * MiB
    assert all(t.mapped_bytes == 0 for t in status.tags)
    llm.wake_up()
