"""The Triton prefill kernel against the torch reference: on the GPU, and on the CPU through
Triton's interpreter (in a subprocess, since ``TRITON_INTERPRET`` is read when triton is
imported)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from dormant.layers.attention import paged_attention_reference
from tests.layers.attention_metadata import build_attention_metadata
from tests.triton_interpreter import run_interpreted

# (seq_len, query_len): a fresh prompt; a cached prefix of 37 (not block-aligned) + 20 new; one
# token over a long context; a long prompt spanning several query tiles; a long chunk over a
# cached prefix; a sequence's first token.
BATCH = [(50, 50), (57, 20), (200, 1), (300, 300), (250, 150), (1, 1)]
# A smaller batch for the interpreter, with the same kinds of sequence.
SMALL_BATCH = [(20, 20), (57, 20), (70, 1), (100, 100), (1, 1)]
# (cache dtype, query dtype, num_heads, num_kv_heads, head_dim, block_size); the interpreter
# cannot emulate bf16 products.
INTERPRETER_CASES = [
    (torch.float32, torch.float32, 4, 2, 32, 16),
    (torch.float32, torch.float32, 4, 4, 16, 16),
    (torch.float32, torch.float32, 4, 1, 16, 8),
    (torch.float16, torch.float16, 4, 2, 16, 16),
    (torch.float8_e4m3fn, torch.float32, 4, 2, 16, 16),
    (torch.float32, torch.float32, 2, 1, 256, 16),  # 32 keys per tile
]


def relative_error(
    batch: list[tuple[int, int]],
    cache_dtype: torch.dtype,
    query_dtype: torch.dtype,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    device: torch.device,
    kernel: str = "prefill",
    max_seq_len: int | None = None,
    **options: object,
) -> float:
    """Runs the kernel (``"prefill"`` or ``"decode"``) and the reference on one random batch;
    returns ``|out - ref| / |ref|``. ``max_seq_len`` overrides the metadata's bound, as a
    captured graph's does (``max_model_len``); ``options`` go to the kernel.

    Every cache entry the kernel must not read is NaN: the slots past each sequence's length in
    its last block, and a spare block that the padding entries of the block tables point at.
    Asserts that the output has no NaN.
    """
    from dormant.layers.triton_attention import paged_decode_attention
    from dormant.layers.triton_prefill import paged_prefill_attention

    attend = paged_prefill_attention if kernel == "prefill" else paged_decode_attention

    torch.manual_seed(0)
    num_table_blocks = max(math.ceil(seq_len / block_size) for seq_len, _ in batch) + 2
    num_blocks = len(batch) * num_table_blocks + 1
    poison = num_blocks - 1
    tables = torch.randperm(num_blocks - 1)[: len(batch) * num_table_blocks]
    tables = tables.view(len(batch), num_table_blocks).int()
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim) * 2
    cache[:, poison] = float("nan")
    for s, (seq_len, _) in enumerate(batch):
        num_used = math.ceil(seq_len / block_size)
        tables[s, num_used:] = poison
        cache[:, tables[s, num_used - 1], seq_len - (num_used - 1) * block_size :] = float("nan")
    k_scale, v_scale = torch.tensor(0.5), torch.tensor(0.25)
    if cache_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        cache = torch.cat([cache[:1] / k_scale, cache[1:] / v_scale]).to(cache_dtype)
    else:
        cache = cache.to(cache_dtype)
        k_scale, v_scale = torch.tensor(1.0), torch.tensor(1.0)
    seq_lens = torch.tensor([seq_len for seq_len, _ in batch], dtype=torch.int32)
    query_lens = torch.tensor([query_len for _, query_len in batch], dtype=torch.int32)
    query = torch.randn(int(query_lens.sum()), num_heads, head_dim, dtype=query_dtype)
    cache, query, tables = cache.to(device), query.to(device), tables.to(device)
    k_scale, v_scale = k_scale.to(device), v_scale.to(device)
    meta = build_attention_metadata(tables, seq_lens, query_lens, block_size)
    if max_seq_len is not None:
        meta = dataclasses.replace(meta, max_seq_len=max_seq_len)
    scale = head_dim**-0.5
    expected = paged_attention_reference(query, cache, meta, scale, k_scale, v_scale).float()
    actual = attend(query, cache, meta, scale, k_scale, v_scale, **options)
    assert actual.shape == query.shape and actual.dtype == query.dtype
    assert not torch.isnan(actual).any()
    return float((actual.float() - expected).norm() / expected.norm())


def tolerance(query_dtype: torch.dtype) -> float:
    return 1e-5 if query_dtype == torch.float32 else 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(8, 8), (32, 8), (16, 2)])
def test_prefill_kernel_matches_the_reference(
    cache_dtype: torch.dtype, num_heads: int, num_kv_heads: int
) -> None:
    query_dtype = torch.float32 if cache_dtype == torch.float32 else torch.bfloat16
    error = relative_error(
        BATCH, cache_dtype, query_dtype, num_heads, num_kv_heads, 128, 16, torch.device("cuda")
    )
    assert error < tolerance(query_dtype), error


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("dtype", "head_dim", "block_size"),
    [(torch.bfloat16, 64, 32), (torch.bfloat16, 64, 8), (torch.float32, 256, 16)],
)
def test_prefill_kernel_other_shapes(dtype: torch.dtype, head_dim: int, block_size: int) -> None:
    cuda = torch.device("cuda")
    error = relative_error(BATCH, dtype, dtype, 16, 2, head_dim, block_size, cuda)
    assert error < tolerance(dtype), error


def test_prefill_kernel_in_the_triton_interpreter() -> None:
    pytest.importorskip("triton")
    script = (
        "import sys, torch\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "import test_triton_prefill as t\n"
        "for case in t.INTERPRETER_CASES:\n"
        "    error = t.relative_error(t.SMALL_BATCH, *case, torch.device('cpu'))\n"
        "    print(case, error)\n"
        "    assert error < t.tolerance(case[1]), (case, error)\n"
    )
    result = run_interpreted(script, timeout_s=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("\n") == len(INTERPRETER_CASES), result.stdout
