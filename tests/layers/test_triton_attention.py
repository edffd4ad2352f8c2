"""The Triton split-KV decode kernel against the torch reference: on the GPU, and on the CPU
through Triton's interpreter. The cases (poisoned slots and padding blocks included) are those
of the prefill kernel's tests, with one new token per sequence."""

from __future__ import annotations

import pytest
import torch

from tests.layers.test_triton_prefill import relative_error, tolerance
from tests.triton_interpreter import run_interpreted

# seq lens: a first token, block-aligned, mid-block, a long context over many splits
DECODE_BATCH = [(1, 1), (17, 1), (100, 1), (333, 1), (16, 1), (3000, 1)]
SMALL_DECODE_BATCH = [(1, 1), (17, 1), (70, 1), (130, 1)]


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(8, 8), (32, 8), (16, 2)])
@pytest.mark.parametrize("max_seq_len", [None, 4096, 40960])  # eager, and as graphs see it
def test_decode_kernel_matches_the_reference(
    cache_dtype: torch.dtype, num_heads: int, num_kv_heads: int, max_seq_len: int | None
) -> None:
    query_dtype = torch.float32 if cache_dtype == torch.float32 else torch.bfloat16
    cuda = torch.device("cuda")
    error = relative_error(
        DECODE_BATCH, cache_dtype, query_dtype, num_heads, num_kv_heads, 128, 16, cuda,
        kernel="decode", max_seq_len=max_seq_len,
    )  # fmt: skip
    assert error < tolerance(query_dtype), error


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [4, 8, 32])
def test_decode_kernel_any_block_size(block_size: int) -> None:
    cuda = torch.device("cuda")
    error = relative_error(
        DECODE_BATCH, torch.bfloat16, torch.bfloat16, 16, 2, 64, block_size, cuda, kernel="decode"
    )
    assert error < tolerance(torch.bfloat16), error


INTERPRETER_CASES = [  # (cache, query, heads, kv heads, head_dim, block_size, max_seq_len)
    (torch.float32, torch.float32, 4, 2, 32, 16, None),
    (torch.float32, torch.float32, 4, 1, 16, 8, 4096),
    (torch.float8_e4m3fn, torch.float32, 4, 2, 16, 16, 300),
]


def test_decode_kernel_in_the_triton_interpreter() -> None:
    pytest.importorskip("triton")
    script = (
        "import torch\n"
        "from tests.layers import test_triton_attention as t\n"
        "for *case, max_seq_len in t.INTERPRETER_CASES:\n"
        "    error = t.relative_error(t.SMALL_DECODE_BATCH, *case, torch.device('cpu'),\n"
        "                             kernel='decode', max_seq_len=max_seq_len)\n"
        "    print(case, error)\n"
        "    assert error < t.tolerance(case[1]), (case, error)\n"
    )
    result = run_interpreted(script, timeout_s=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("\n") == len(INTERPRETER_CASES), result.stdout
