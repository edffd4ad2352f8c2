"""Weight loaders of the parallel layers: each rank takes its shard of the full checkpoint
tensor, in place. Ranks are simulated with a group that has a rank but never communicates."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from dormant.distributed import TPGroup, use_tp_group
from dormant.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from dormant.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)


class RankOnlyGroup(TPGroup):
    """Has a rank and a size; loaders need nothing else."""

    def all_reduce(self, tensor: Tensor) -> Tensor:
        raise AssertionError("loaders must not communicate")

    def all_gather(self, tensor: Tensor, dim: int) -> Tensor:
        raise AssertionError("loaders must not communicate")


def _full(*shape: int) -> Tensor:
    return torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)


def _load(param: torch.nn.Parameter, full: Tensor, shard_id: str | int | None = None) -> None:
    pointer = param.data_ptr()
    param.weight_loader(param, full, shard_id)
    assert param.data_ptr() == pointer  # in place


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_column_and_row_shards_reassemble(tp_size: int) -> None:
    weight, bias = _full(8, 12), _full(8)
    columns, rows = [], []
    for rank in range(tp_size):
        with use_tp_group(RankOnlyGroup(rank, tp_size)):
            column = ColumnParallelLinear(12, 8, bias=True)
            row = RowParallelLinear(8, 12, bias=True)
        _load(column.weight, weight)
        _load(column.bias, bias)
        _load(row.weight, weight.T.contiguous())
        _load(row.bias, _full(12))
        assert torch.equal(row.bias, _full(12))  # the row bias is replicated, not sharded
        assert column.weight.loaded_shape(column.weight) == weight.shape
        columns.append(column)
        rows.append(row)
    assert torch.equal(torch.cat([c.weight for c in columns]), weight)
    assert torch.equal(torch.cat([c.bias for c in columns]), bias)
    assert torch.equal(torch.cat([r.weight for r in rows], dim=1), weight.T)


def test_merged_column_places_each_part() -> None:
    gate, up = _full(6, 4), 100 + _full(6, 4)
    for rank in range(2):
        with use_tp_group(RankOnlyGroup(rank, 2)):
            layer = MergedColumnParallelLinear(4, [6, 6], bias=False)
        _load(layer.weight, gate, 0)
        _load(layer.weight, up, 1)
        expected = torch.cat([gate[3 * rank : 3 * rank + 3], up[3 * rank : 3 * rank + 3]])
        assert torch.equal(layer.weight, expected)


@pytest.mark.parametrize(("tp_size", "num_kv_heads"), [(1, 2), (2, 2), (4, 2), (4, 1)])
def test_qkv_shards_heads_and_replicates_kv(tp_size: int, num_kv_heads: int) -> None:
    num_heads, head_dim, hidden = 8, 2, 3
    q = _full(num_heads * head_dim, hidden)
    k = 1000 + _full(num_kv_heads * head_dim, hidden)
    v = 2000 + _full(num_kv_heads * head_dim, hidden)
    group = num_heads // num_kv_heads
    for rank in range(tp_size):
        with use_tp_group(RankOnlyGroup(rank, tp_size)):
            layer = QKVParallelLinear(hidden, head_dim, num_heads, num_kv_heads, bias=True)
        for shard_id, full in (("q", q), ("k", k), ("v", v)):
            _load(layer.weight, full, shard_id)
            _load(layer.bias, full[:, 0].contiguous(), shard_id)
        heads = range(rank * layer.local_num_heads, (rank + 1) * layer.local_num_heads)
        kv_heads = sorted({h // group for h in heads})  # exactly the kv heads these q heads use
        assert len(kv_heads) == layer.local_num_kv_heads

        def rows(full: Tensor, ids: list[int]) -> Tensor:
            return torch.cat([full[i * head_dim : (i + 1) * head_dim] for i in ids])

        expected = torch.cat([rows(q, list(heads)), rows(k, kv_heads), rows(v, kv_heads)])
        assert torch.equal(layer.weight, expected)
        assert torch.equal(layer.bias, expected[:, 0])


def test_qkv_rejects_uneven_split() -> None:
    with use_tp_group(RankOnlyGroup(0, 4)), pytest.raises(ValueError, match="TP size"):
        QKVParallelLinear(8, 2, 8, 3, bias=False)


def test_vocab_parallel_embedding_and_head_shard_rows() -> None:
    table = _full(10, 3)
    for rank in range(2):
        with use_tp_group(RankOnlyGroup(rank, 2)):
            embedding = VocabParallelEmbedding(10, 3)
            head = ParallelLMHead(10, 3)
        _load(embedding.weight, table)
        _load(head.weight, table)
        assert torch.equal(embedding.weight, table[5 * rank : 5 * rank + 5])
        assert torch.equal(head.weight, embedding.weight)
    with use_tp_group(RankOnlyGroup(0, 4)), pytest.raises(ValueError, match="vocabulary"):
        VocabParallelEmbedding(10, 3)


def test_bad_shapes_and_shard_ids_raise_and_leave_params_untouched() -> None:
    layer = QKVParallelLinear(3, 2, 4, 2, bias=False)
    merged = MergedColumnParallelLinear(3, [4, 4], bias=False)
    replicated = ReplicatedLinear(3, 4, bias=True)
    for param in (layer.weight, merged.weight, replicated.weight, replicated.bias):
        param.data.fill_(7.0)
    cases = [
        (layer.weight, _full(4 * 2 + 1, 3), "q", "shape"),
        (layer.weight, _full(8, 3), "x", "'q', 'k' or 'v'"),
        (merged.weight, _full(4, 3), 2, r"\[0, 2\)"),
        (merged.weight, _full(4, 3), None, "shard id"),
        (replicated.weight, _full(3, 4), None, r"expected the full unsharded shape \(4, 3\)"),
        (replicated.bias, _full(4), "q", "not packed"),
    ]
    for param, loaded, shard_id, match in cases:
        with pytest.raises(ValueError, match=match):
            param.weight_loader(param, loaded, shard_id)
        assert torch.all(param == 7.0)


def test_replicated_linear_matches_torch() -> None:
    layer = ReplicatedLinear(4, 3, bias=True)
    weight, bias = torch.randn(3, 4), torch.randn(3)
    _load(layer.weight, weight)
    _load(layer.bias, bias)
    x = torch.randn(2, 4)
    torch.testing.assert_close(layer(x), x @ weight.T + bias)
