"""The prior art's lifecycle at TP=2 on two GPUs (NCCL), with FULL and fused multi-step graphs:
tokens identical on every rank, layout pointers unchanged (guards), residual and timings per rank.

Needs two GPUs; skipped otherwise. NVLink multicast stays off (NCCL_NVLS_ENABLE=0), and NCCL's
graph buffer registration is off (NCCL_GRAPH_REGISTER=0): with it, NCCL kept the old physical
pages of a registered buffer after a same-address resume and replays hung (torch_memory_saver#88).
"""

from __future__ import annotations

import os

import pytest
import torch

from dormant import LLM, SamplingParams
from dormant.core.commands import Command
from dormant.engine.batch import ScheduledBatch
from tests.engine.conftest import PROMPTS, write_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs"),
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def multi_step(llm: LLM) -> list[list[int]]:
    engine = llm.llm_engine
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS]
    engine.step()
    running = [engine.scheduler._unfinished_by_id[i] for i in ids]
    step = ScheduledBatch.of([(seq, 1) for seq in running]).step_input(engine.runtime.eos_token_ids)
    per_rank = engine.executor.run(Command.EXECUTE_MULTI_STEP, step)
    engine.abort_request(ids)
    assert per_rank[0] == per_rank[1]  # every rank sampled the same tokens
    seqs = per_rank[0].seqs
    return [[s.output_token_ids[0], *o.token_ids] for s, o in zip(running, seqs, strict=True)]


def test_tp2_lifecycle_on_two_gpus(tmp_path) -> None:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("NCCL_GRAPH_REGISTER", "0")
    checkpoint = write_checkpoint(tmp_path / "ckpt", seed=1)
    llm = LLM(
        str(checkpoint),
        tensor_parallel_size=2,
        device="cuda",
        dtype="bfloat16",
        max_model_len=256,
        max_num_seqs=8,
        kv_cache_memory_bytes=16 << 20,
    )
    try:
        full = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
        fused = multi_step(llm)
        assert [list(t[:5]) for t in full] == fused
        for level in (2, 1, 2):
            llm.sleep(level=level)
            for rank, status in enumerate(llm.memory_status()):
                print(f"rank {rank} asleep at level {level}:\n{status.table()}")
            llm.wake_up(["weights"])
            if level == 2:
                llm.collective_rpc("reload_weights")
            llm.wake_up(["kv_cache"])
            for rank, status in enumerate(llm.memory_status()):
                sleep, wake = status.last_sleep, status.last_wake
                print(
                    f"rank {rank}: sleep {sleep.total_s * 1e3:.1f} ms, last wake "
                    f"{wake.total_s * 1e3:.1f} ms"
                )
            assert llm.collective_rpc("verify_guards") == [None, None]  # same addresses
            assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == full
            assert multi_step(llm) == fused
    finally:
        llm.shutdown()
