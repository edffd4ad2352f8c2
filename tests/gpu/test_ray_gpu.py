"""The Ray executor at TP=1 on one GPU (issue #21), through the lifecycle of
``test_engine_graphs.py``: the worker is a Ray actor on a GPU bundle, CUDA graphs are captured
there, and after level-1 and level-2 cycles (with a reload) the tokens equal an in-process
engine's, every graph-visible tensor keeps its address and the guards hold. Skipped without
Ray (``pip install 'dormant[ray]'``) or CUDA."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from dormant import LLM, SamplingParams
from tests.engine.conftest import PROMPTS, write_checkpoint

pytestmark = pytest.mark.gpu
ray = pytest.importorskip("ray", reason="the Ray executor needs Ray: pip install 'dormant[ray]'")
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=16, ignore_eos=True)
OPTIONS = dict(device="cuda", dtype="bfloat16", max_model_len=256, max_num_seqs=8)
MiB = 1 << 20


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    ray.init(num_gpus=1, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def tokens(llm: LLM, params: SamplingParams = GREEDY) -> list[tuple[int, ...]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.mark.parametrize("level", [1, 2])
def test_ray_executor_lifecycle_at_tp1(cluster, tmp_path, level: int) -> None:
    def graph_state(worker: Any) -> dict[str, Any]:
        """In the actor (sent by value): the graphs, and (id, address) of what they touch."""
        graphs = worker.runner.graphs
        tensors = [*worker.runner.inputs.tensors()]
        tensors += [a.kv_cache for a in worker.model.attention_layers()]
        tensors += [g.output for g in (*graphs.full.values(), *graphs.multi_step.values())]
        return {
            "device": str(worker.device),
            "num_full": len(graphs.full),
            "num_multi_step": len(graphs.multi_step),
            "pointers": [(id(t), t.data_ptr()) for t in tensors],
        }

    checkpoint = write_checkpoint(tmp_path / "ckpt", seed=1)
    with LLM(str(checkpoint), kv_cache_memory_bytes=16 * MiB, **OPTIONS) as reference:
        want, want_seeded = tokens(reference), tokens(reference, SEEDED)
    llm = LLM(
        str(checkpoint),
        distributed_executor_backend="ray",
        kv_cache_memory_bytes=16 * MiB,
        **OPTIONS,
    )
    try:
        assert type(llm.llm_engine.executor).__name__ == "RayExecutor"
        before = llm.collective_rpc(graph_state)[0]
        print(f"Ray worker on {before['device']}: {before['num_full']} FULL graphs, "
              f"{before['num_multi_step']} multi-step graphs")  # fmt: skip
        assert before["device"].startswith("cuda") and before["num_full"] > 0
        assert tokens(llm) == want and tokens(llm, SEEDED) == want_seeded
        for _ in range(2):
            llm.sleep(level=level)
            status = llm.memory_status()[0]
            print(f"asleep at level {level}:\n{status.table()}")
            assert status.tag("kv_cache").mapped_bytes == 0
            llm.wake_up(["weights"])
            if level == 2:
                llm.collective_rpc("reload_weights")
            llm.wake_up(["kv_cache"])
            assert llm.collective_rpc(graph_state)[0]["pointers"] == before["pointers"]
            assert llm.collective_rpc("verify_guards") == [None]
            assert tokens(llm) == want and tokens(llm, SEEDED) == want_seeded
    finally:
        pids = llm.llm_engine.executor.pids
        llm.shutdown()
    print(f"Ray worker pids {pids} shut down")
