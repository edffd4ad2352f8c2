"""The lifecycle matrix for a Qwen3-MoE on the GPU, with the fused Triton MoE kernels in FULL
and fused multi-step CUDA graphs: level 1, and level 2 with a refit by HF per-expert names;
bf16 and fp8 KV. Tokens are identical before and after every cycle, the layout pointers and
the fused expert tensors never move, nothing is recaptured. Also: a refit to new weights (in
process, and by CUDA IPC from a trainer process) equals a fresh engine; graphs decode what
eager decodes."""

from __future__ import annotations

import multiprocessing as mp
from multiprocessing.connection import Connection
from pathlib import Path

import pytest

from dormant import LLM, SamplingParams
from dormant.worker.ipc_weights import FLATTENED_BUCKET, flattened_bucket_request
from tests.engine.conftest import PROMPTS
from tests.engine.moe_checkpoint import moe_state_dict, write_moe_checkpoint
from tests.gpu.conftest import make_engine
from tests.gpu.test_engine_graphs import graph_visible, multi_step_tokens

pytestmark = pytest.mark.gpu
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=16, ignore_eos=True)
# Big enough for several tiles per expert; a dense layer between two sparse ones.
SIZES = dict(
    hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_experts=32,
    num_experts_per_tok=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
)  # fmt: skip
MiB = 1 << 20


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return (
        write_moe_checkpoint(tmp_path_factory.mktemp("moe_gpu_a"), seed=1, **SIZES),
        write_moe_checkpoint(tmp_path_factory.mktemp("moe_gpu_b"), seed=2, **SIZES),
    )


def tokens(llm: LLM, params: SamplingParams = GREEDY) -> list[tuple[int, ...]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]


def expert_pointers(llm: LLM) -> list[int]:
    model = llm.llm_engine.executor.worker.model
    return [
        p.data_ptr()
        for layer in model.model.layers
        if hasattr(layer.mlp, "experts")
        for p in (layer.mlp.experts.w13_weight, layer.mlp.experts.w2_weight)
    ]


def cycle(llm: LLM, level: int, refit_from: Path) -> None:
    """generate → sleep(level) → wake weights → (refit by per-expert names) → wake KV."""
    llm.sleep(level=level)
    llm.wake_up(["weights"])
    if level == 2:
        weights = moe_state_dict(refit_from)
        assert sum(".experts." in name for name in weights) == 2 * 32 * 3
        llm.update_weights(weights)
    llm.wake_up(["kv_cache"])


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("level", [1, 2])
def test_moe_lifecycle_with_full_and_multi_step_graphs(
    engines, checkpoints, kv_cache_dtype: str, level: int
) -> None:
    llm = make_engine(
        engines, checkpoints[0], dtype="bfloat16", kv_cache_dtype=kv_cache_dtype,
        memory_poison=True,
    )  # fmt: skip
    graphs = llm.llm_engine.executor.worker.runner.graphs
    assert graphs is not None and graphs.multi_step
    full, seeded, multi = tokens(llm), tokens(llm, SEEDED), multi_step_tokens(llm)
    assert [list(t[:5]) for t in full] == multi  # the fused graph decodes what single steps do
    pointers, experts = graph_visible(llm), expert_pointers(llm)
    for _ in range(2):
        cycle(llm, level, refit_from=checkpoints[0])
        assert graph_visible(llm) == pointers and expert_pointers(llm) == experts
        assert tokens(llm) == full and tokens(llm, SEEDED) == seeded
        assert multi_step_tokens(llm) == multi
    llm.collective_rpc("verify_guards")


def test_moe_refit_to_new_weights_equals_a_fresh_engine(engines, checkpoints) -> None:
    fresh = make_engine(engines, checkpoints[1], dtype="bfloat16")
    expected = tokens(fresh)
    engines.pop().shutdown()  # one engine per GPU at a time
    llm = make_engine(engines, checkpoints[0], dtype="bfloat16")
    before = tokens(llm)
    cycle(llm, 2, refit_from=checkpoints[1])
    assert tokens(llm) == expected != before


def test_moe_graphs_decode_what_eager_decodes(engines, checkpoints) -> None:
    graphs = tokens(make_engine(engines, checkpoints[0]))
    engines.pop().shutdown()
    assert graphs == tokens(make_engine(engines, checkpoints[0], enforce_eager=True))


def _trainer(conn: Connection, checkpoint: str) -> None:
    weights = [(n, t.to("cuda")) for n, t in moe_state_dict(Path(checkpoint)).items()]
    entries, flat = flattened_bucket_request(weights)
    conn.send(entries)
    conn.recv()  # the engine copied them: the buffers may go
    del flat


def test_moe_ipc_refit_after_level_2_equals_a_fresh_engine(engines, checkpoints) -> None:
    """A trainer process on the same GPU sends every expert by name as one flattened bucket
    of CUDA IPC handles (SGLang's format)."""
    expected = tokens(make_engine(engines, checkpoints[1]))
    engines.pop().shutdown()
    llm = make_engine(engines, checkpoints[0])
    llm.sleep(level=2)
    llm.wake_up(["weights"])
    context = mp.get_context("spawn")
    conn, child = context.Pipe()
    trainer = context.Process(target=_trainer, args=(child, str(checkpoints[1])))
    trainer.start()
    try:
        llm.update_weights_from_tensor(conn.recv(), load_format=FLATTENED_BUCKET)
        conn.send(True)
    finally:
        trainer.join(timeout=60)
    llm.wake_up(["kv_cache"])
    assert tokens(llm) == expected
