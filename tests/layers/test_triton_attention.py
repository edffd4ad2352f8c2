"""The Triton decode kernel against the torch reference, on the GPU."""

from __future__ import annotations

import pytest
import torch

from dormant.layers.attention import paged_attention_reference
from dormant.layers.context import build_attention_metadata

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(8, 8), (32, 8), (16, 2)])
def test_decode_kernel_matches_the_reference(cache_dtype, num_heads, num_kv_heads) -> None:
    from dormant.layers.triton_attention import paged_decode_attention

    torch.manual_seed(0)
    head_dim, block_size, num_blocks = 128, 16, 128
    seq_lens = torch.tensor([1, 17, 100, 333, 16], dtype=torch.int32)
    num_seqs = len(seq_lens)
    tables = torch.randperm(num_blocks - 1)[: num_seqs * 22].view(num_seqs, 22).int()
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim) * 2
    cache[:, num_blocks - 1] = float("nan")  # an unused block, poisoned: must never be read
    tables[0, 1:] = num_blocks - 1  # padding entries point at it
    k_scale, v_scale = torch.tensor(0.5), torch.tensor(0.25)
    if cache_dtype == torch.float8_e4m3fn:
        cache = torch.cat([(cache[:1] / k_scale), (cache[1:] / v_scale)]).to(cache_dtype)
    else:
        cache = cache.to(cache_dtype)
        k_scale, v_scale = torch.tensor(1.0), torch.tensor(1.0)
    query_dtype = torch.bfloat16 if cache_dtype != torch.float32 else torch.float32
    query = torch.randn(num_seqs, num_heads, head_dim, dtype=query_dtype)
    device = torch.device("cuda")
    cache, query, tables, seq_lens = (t.to(device) for t in (cache, query, tables, seq_lens))
    k_scale, v_scale = k_scale.to(device), v_scale.to(device)
    meta = build_attention_metadata(tables, seq_lens, torch.ones_like(seq_lens), block_size)
    expected = paged_attention_reference(query, cache, meta, 0.088, k_scale, v_scale).float()
    actual = paged_decode_attention(query, cache, meta, 0.088, k_scale, v_scale).float()
    assert not torch.isnan(actual).any()
    error = (actual - expected).norm() / expected.norm()
    assert error < (1e-5 if query_dtype == torch.float32 else 1e-2), float(error)
