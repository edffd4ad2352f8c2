"""TP=2 on CPU (gloo, two spawned processes) gives the same outputs as TP=1.

One spawn runs every case; each rank records per case "ok" or the traceback, and each test
asserts on its case.
"""

from __future__ import annotations

import json
import socket
import traceback
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import Tensor

from dormant.distributed import DistributedTPGroup, SingleRankGroup, TPGroup, use_tp_group
from dormant.layers.context import forward_context
from dormant.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from dormant.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from dormant.models import CausalLM, ModelConfig, build_model
from tests.layers.attention_metadata import build_attention_metadata

WORLD_SIZE = 2


def _randn(*shape: int, seed: int) -> Tensor:
    """The same numbers on every rank."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _load(param: torch.nn.Parameter, full: Tensor, shard_id: str | int | None = None) -> None:
    param.weight_loader(param, full, shard_id)


def case_collectives(group: TPGroup) -> None:
    x = torch.full((2, 3), float(group.rank + 1))
    assert torch.equal(group.all_reduce(x.clone()), torch.full((2, 3), 3.0))
    gathered = group.all_gather(x, dim=1)
    assert torch.equal(gathered, torch.cat([torch.full((2, 3), 1.0), torch.full((2, 3), 2.0)], 1))


def case_column_and_row(group: TPGroup) -> None:
    weight, bias, x = _randn(8, 12, seed=0), _randn(8, seed=1), _randn(3, 12, seed=2)
    column = ColumnParallelLinear(12, 8, bias=True)
    _load(column.weight, weight)
    _load(column.bias, bias)
    torch.testing.assert_close(group.all_gather(column(x), dim=-1), F.linear(x, weight, bias))

    row_weight, row_bias = _randn(5, 8, seed=3), 100 + _randn(5, seed=4)  # a bias added twice shows
    row = RowParallelLinear(8, 5, bias=True)
    _load(row.weight, row_weight)
    _load(row.bias, row_bias)
    h = _randn(3, 8, seed=5)
    local_h = h.chunk(WORLD_SIZE, dim=-1)[group.rank]
    torch.testing.assert_close(row(local_h), F.linear(h, row_weight, row_bias))


def case_merged_and_qkv(group: TPGroup) -> None:
    x = _randn(3, 16, seed=0)
    gate, up = _randn(8, 16, seed=1), _randn(8, 16, seed=2)
    merged = MergedColumnParallelLinear(16, [8, 8], bias=False)
    _load(merged.weight, gate, 0)
    _load(merged.weight, up, 1)
    local_gate, local_up = merged(x).chunk(2, dim=-1)
    torch.testing.assert_close(group.all_gather(local_gate, -1), x @ gate.T)
    torch.testing.assert_close(group.all_gather(local_up, -1), x @ up.T)

    for num_kv_heads in (2, 1):  # split, then replicated kv heads
        head_dim = 4
        q, k, v = (
            _randn(n * head_dim, 16, seed=s)
            for n, s in ((4, 3), (num_kv_heads, 4), (num_kv_heads, 5))
        )
        qkv = QKVParallelLinear(16, head_dim, 4, num_kv_heads, bias=False)
        for shard_id, full in (("q", q), ("k", k), ("v", v)):
            _load(qkv.weight, full, shard_id)
        local_q, local_k, local_v = qkv(x).split([qkv.q_size, qkv.kv_size, qkv.kv_size], -1)
        torch.testing.assert_close(group.all_gather(local_q, -1), x @ q.T)
        kv_rows = slice(qkv.kv_head_start * head_dim, qkv.kv_head_start * head_dim + qkv.kv_size)
        torch.testing.assert_close(local_k, x @ k[kv_rows].T)
        torch.testing.assert_close(local_v, x @ v[kv_rows].T)


def case_vocab_parallel(group: TPGroup) -> None:
    table, hidden = _randn(10, 6, seed=0), _randn(4, 6, seed=1)
    embedding, head = VocabParallelEmbedding(10, 6), ParallelLMHead(10, 6)
    _load(embedding.weight, table)
    _load(head.weight, table)
    ids = torch.tensor([0, 4, 5, 9, 3])  # both halves of the vocabulary
    torch.testing.assert_close(embedding(ids), F.embedding(ids, table))
    logits = head(hidden)
    assert logits.dtype == torch.float32 and logits.shape == (4, 10)
    torch.testing.assert_close(logits, hidden @ table.T)


def _tiny_config(architecture: str) -> ModelConfig:
    return ModelConfig.from_dict(
        {
            "architectures": [architecture],
            "vocab_size": 64,
            "hidden_size": 32,
            "intermediate_size": 48,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2 if architecture == "LlamaForCausalLM" else 1,
            "head_dim": 8,
            "max_position_embeddings": 64,
            "attention_bias": architecture == "LlamaForCausalLM",
            "mlp_bias": architecture == "LlamaForCausalLM",
            "dtype": "float32",
        }
    )


def _build(config: ModelConfig, group: TPGroup) -> CausalLM:
    with use_tp_group(group):
        model = build_model(config)
    model.init_buffers()
    model.reset_kv_scales()
    model.init_random_weights(seed=0)
    shapes = model.expected_weight_shapes()
    biases = [(n, shape) for n, shape in shapes.items() if n.endswith("bias")]
    for i, (name, shape) in enumerate(biases):  # non-zero, so a bias added twice would show
        model.load_weights([(name, 1 + _randn(*shape, seed=100 + i))])
    for layer in model.attention_layers():
        layer.kv_cache = torch.zeros(2, 8, 4, layer.num_kv_heads, layer.head_dim)
    return model


def _step(model: CausalLM, tables: Tensor, seq_lens: list[int], new: list[list[int]]) -> Tensor:
    query_lens = [len(tokens) for tokens in new]
    meta = build_attention_metadata(tables, torch.tensor(seq_lens), torch.tensor(query_lens), 4)
    positions = torch.cat(
        [torch.arange(s - q, s) for s, q in zip(seq_lens, query_lens, strict=True)]
    )
    ids = torch.tensor([t for tokens in new for t in tokens])
    with forward_context(meta):
        return model.compute_logits(model(ids, positions))


def case_whole_models(group: TPGroup) -> None:
    tables = torch.tensor([[3, 0, 5], [1, 7, 2]], dtype=torch.int32)
    for architecture in ("LlamaForCausalLM", "Qwen3ForCausalLM"):
        config = _tiny_config(architecture)
        sharded, single = _build(config, group), _build(config, SingleRankGroup())
        assert sharded.attention_layers()[0].num_heads == 2
        prompts = [[1, 2, 3, 40, 50], [7, 8, 9]]
        seq_lens, new = [5, 3], prompts
        for _ in range(3):  # a prefill, then two decode steps
            ours, reference = (_step(m, tables, seq_lens, new) for m in (sharded, single))
            assert ours.shape == (sum(map(len, new)), 64)
            torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)
            last = reference[torch.tensor([len(new[0]) - 1, len(new[0]) + len(new[1]) - 1])]
            new = [[int(t)] for t in last.argmax(-1)]
            seq_lens = [s + 1 for s in seq_lens]


CASES: dict[str, Callable[[TPGroup], None]] = {
    "collectives": case_collectives,
    "column_and_row": case_column_and_row,
    "merged_and_qkv": case_merged_and_qkv,
    "vocab_parallel": case_vocab_parallel,
    "whole_models": case_whole_models,
}


def _worker(rank: int, port: int, out_dir: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE
    )
    results: dict[str, str] = {}
    try:
        group = DistributedTPGroup()
        with use_tp_group(group):
            for name, case in CASES.items():
                try:
                    case(group)
                    results[name] = "ok"
                except Exception:
                    results[name] = traceback.format_exc()
    finally:
        dist.destroy_process_group()
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tp_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, str]]:
    out_dir = tmp_path_factory.mktemp("tp")
    mp.spawn(_worker, args=(_free_port(), str(out_dir)), nprocs=WORLD_SIZE, join=True)
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(WORLD_SIZE)]


@pytest.mark.parametrize("case", list(CASES))
def test_tp2_matches_tp1(case: str, tp_results: list[dict[str, str]]) -> None:
    for rank, results in enumerate(tp_results):
        assert results.get(case) == "ok", f"rank {rank}:\n{results.get(case)}"
