"""Qwen3-MoE under tensor parallelism on the CPU (gloo, TP=2): each rank holds a slice of every
expert's intermediate dimension, one all-reduce after the experts; the tokens equal TP=1's,
after a level-2 refit by HF per-expert names and after one by transformers 5's fused expert
names (the dense TP tests cover the level-1 cycle)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from dormant import LLM
from tests.engine.conftest import GREEDY, PROMPTS
from tests.engine.moe_checkpoint import hf_moe_model, moe_state_dict, write_moe_checkpoint

OPTIONS = dict(device="cpu", max_model_len=256, max_num_seqs=8, kv_cache_memory_bytes=4 << 20)


def tokens(llm: LLM) -> list[tuple[int, ...]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return (
        write_moe_checkpoint(tmp_path_factory.mktemp("moe_tp_a"), seed=1),
        write_moe_checkpoint(tmp_path_factory.mktemp("moe_tp_b"), seed=2),
    )


@pytest.fixture(scope="module")
def expected(checkpoints) -> dict[str, list]:
    a, b = checkpoints
    with LLM(str(a), **OPTIONS) as llm:
        result = {"greedy": tokens(llm)}
    with LLM(str(b), **OPTIONS) as llm:
        result["greedy_b"] = tokens(llm)
    return result


@pytest.fixture(scope="module")
def tp2(checkpoints) -> Iterator[LLM]:
    llm = LLM(str(checkpoints[0]), tensor_parallel_size=2, **OPTIONS)
    yield llm
    llm.shutdown()


def test_tp2_moe_equals_tp1(tp2: LLM, expected) -> None:
    def local_shapes(worker) -> tuple[tuple[int, ...], tuple[int, ...]]:
        experts = worker.model.model.layers[0].mlp.experts
        return tuple(experts.w13_weight.shape), tuple(experts.w2_weight.shape)

    # moe_intermediate_size 32: 16 rows of gate and 16 of up per expert on each rank
    assert tp2.collective_rpc(local_shapes) == [((8, 32, 64), (8, 64, 16))] * 2
    assert tokens(tp2) == expected["greedy"]


def test_tp2_moe_level_2_refit_by_expert_names(tp2: LLM, expected, checkpoints) -> None:
    tp2.sleep(level=2)
    tp2.wake_up(["weights"])
    tp2.update_weights(moe_state_dict(checkpoints[1]))  # every rank takes its slices
    tp2.wake_up(["kv_cache"])
    assert tokens(tp2) == expected["greedy_b"]
    tp2.update_weights(hf_moe_model(1).state_dict())  # transformers 5's fused expert names
    assert tokens(tp2) == expected["greedy"]
