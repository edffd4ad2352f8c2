"""Paged attention against a dense causal reference."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from dormant.layers.attention import KVCacheNotSetError, PagedAttention, write_kv_cache
from dormant.layers.context import (
    ForwardContextError,
    forward_context,
)
from tests.layers.attention_metadata import build_attention_metadata

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 8, 2, 16
# (seq_len, query_len): full prefill, decode, prefill over a cached prefix, first token, decode
BATCH = [(7, 7), (13, 1), (20, 6), (1, 1), (33, 1)]


def _dense_reference(q: Tensor, keys: Tensor, values: Tensor, scale: float) -> Tensor:
    """Causal attention of the last ``len(q)`` positions over ``keys``/``values`` (float64)."""
    seq_len, num_new = keys.shape[0], q.shape[0]
    group = q.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(group, dim=1)
    v = values.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    query_pos = torch.arange(seq_len - num_new, seq_len)[:, None]
    scores = scores.masked_fill(torch.arange(seq_len)[None, :] > query_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def _quantized(x: Tensor, scale: float, dtype: torch.dtype) -> Tensor:
    if dtype == torch.float8_e4m3fn:
        return (x / scale).to(dtype).float() * scale
    return x


def _make_batch(block_size: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """Shuffled block tables, padded with out-of-range ids that must never be read."""
    max_blocks = max(math.ceil(s / block_size) for s, _ in BATCH) + 2
    num_blocks = sum(math.ceil(s / block_size) for s, _ in BATCH) + 3
    order = torch.randperm(num_blocks, generator=generator).tolist()
    tables = torch.full((len(BATCH), max_blocks), 10**6, dtype=torch.int32)
    for s, (seq_len, _) in enumerate(BATCH):
        for j in range(math.ceil(seq_len / block_size)):
            tables[s, j] = order.pop()
    return tables, torch.tensor(num_blocks)


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float8_e4m3fn])
def test_matches_dense_reference(block_size: int, cache_dtype: torch.dtype, device: str) -> None:
    generator = torch.Generator().manual_seed(block_size)
    tables, num_blocks = _make_batch(block_size, generator)
    layer = PagedAttention(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5, layer_idx=0)
    k_scale, v_scale = (0.05, 0.02) if cache_dtype == torch.float8_e4m3fn else (1.0, 1.0)
    layer.k_scale.fill_(k_scale)
    layer.v_scale.fill_(v_scale)
    shape = (2, int(num_blocks), block_size, NUM_KV_HEADS, HEAD_DIM)
    layer.kv_cache = torch.full(shape, float("nan")).to(cache_dtype)  # unwritten slots are NaN

    def randn(*size: int) -> Tensor:
        return torch.randn(*size, generator=generator)

    keys = [randn(s, NUM_KV_HEADS, HEAD_DIM) for s, _ in BATCH]
    values = [randn(s, NUM_KV_HEADS, HEAD_DIM) for s, _ in BATCH]
    queries = [randn(q, NUM_HEADS, HEAD_DIM) for _, q in BATCH]
    seq_lens = torch.tensor([s for s, _ in BATCH])
    query_lens = torch.tensor([q for _, q in BATCH])

    # The cached prefixes, as an earlier step would have written them.
    cached_lens = seq_lens - query_lens
    has_prefix = cached_lens > 0
    if bool(has_prefix.any()):
        earlier = build_attention_metadata(
            tables[has_prefix], cached_lens[has_prefix], cached_lens[has_prefix], block_size
        )
        chosen = [i for i in range(len(BATCH)) if has_prefix[i]]
        write_kv_cache(
            layer.kv_cache,
            torch.cat([keys[i][: cached_lens[i]] for i in chosen]),
            torch.cat([values[i][: cached_lens[i]] for i in chosen]),
            earlier.slot_mapping,
            layer.k_scale,
            layer.v_scale,
        )

    new_k = torch.cat([k[s - q :] for k, (s, q) in zip(keys, BATCH, strict=True)])
    new_v = torch.cat([v[s - q :] for v, (s, q) in zip(values, BATCH, strict=True)])
    layer.to(device)
    layer.kv_cache = layer.kv_cache.to(device)
    meta = build_attention_metadata(tables.to(device), seq_lens, query_lens, block_size)
    inputs = (torch.cat(queries).flatten(1), new_k.flatten(1), new_v.flatten(1))
    with forward_context(meta):
        out = layer(*(x.to(device) for x in inputs)).cpu()
    dtype, scale = cache_dtype, layer.scale

    expected = torch.cat(
        [
            _dense_reference(q, _quantized(k, k_scale, dtype), _quantized(v, v_scale, dtype), scale)
            for q, k, v in zip(queries, keys, values, strict=True)
        ]
    )
    assert out.shape == (int(query_lens.sum()), NUM_HEADS * HEAD_DIM)
    torch.testing.assert_close(out, expected.flatten(1).float(), rtol=1e-5, atol=1e-5)
    # The new keys landed in their slots.
    stored = layer.kv_cache[0].view(-1, NUM_KV_HEADS, HEAD_DIM)[meta.slot_mapping].cpu()
    torch.testing.assert_close(stored.float() * k_scale, _quantized(new_k, k_scale, cache_dtype))


def test_bf16_cache_with_bf16_inputs() -> None:
    generator = torch.Generator().manual_seed(0)
    layer = PagedAttention(4, 4, 8, 8**-0.5, layer_idx=3)
    layer.kv_cache = torch.zeros(2, 4, 4, 4, 8, dtype=torch.bfloat16)
    q, k, v = (torch.randn(6, 32, generator=generator, dtype=torch.bfloat16) for _ in range(3))
    meta = build_attention_metadata(
        torch.tensor([[2, 0]], dtype=torch.int32), torch.tensor([6]), torch.tensor([6]), 4
    )
    with forward_context(meta):
        out = layer(q, k, v)
    assert out.dtype == torch.bfloat16
    expected = _dense_reference(q.view(6, 4, 8), k.view(6, 4, 8), v.view(6, 4, 8), layer.scale)
    torch.testing.assert_close(out.float(), expected.flatten(1).float(), rtol=2e-2, atol=2e-2)


def test_errors_are_clear() -> None:
    layer = PagedAttention(4, 2, 8, 1.0, layer_idx=5)
    q, kv = torch.zeros(1, 32), torch.zeros(1, 16)
    meta = build_attention_metadata(
        torch.zeros(1, 1, dtype=torch.int32), torch.tensor([1]), torch.tensor([1]), 4
    )
    with pytest.raises(ForwardContextError, match="forward_context"):
        layer(q, kv, kv)
    with forward_context(meta), pytest.raises(KVCacheNotSetError, match="layer 5"):
        layer(q, kv, kv)
    layer.kv_cache = torch.zeros(2, 1, 4, 4, 8)  # 4 kv heads, not 2
    with forward_context(meta), pytest.raises(ValueError, match="kv_cache shape"):
        layer(q, kv, kv)
    with pytest.raises(ValueError, match="multiple"):
        PagedAttention(6, 4, 8, 1.0, layer_idx=0)


def test_scales_are_persistent_float32_buffers() -> None:
    layer = PagedAttention(4, 2, 8, 1.0, layer_idx=0)
    assert set(layer.state_dict()) == {"k_scale", "v_scale"}
    assert layer.k_scale.dtype == torch.float32 and float(layer.k_scale) == 1.0
    layer.k_scale.fill_(3.0)
    layer.reset_kv_scales()
    assert float(layer.k_scale) == 1.0
