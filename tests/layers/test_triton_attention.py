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
@pytest.mark.parametrize("programs_per_sm", [8, 0])  # split as a small batch is; one split
def test_decode_kernel_matches_the_reference(
    cache_dtype: torch.dtype,
    num_heads: int,
    num_kv_heads: int,
    max_seq_len: int | None,
    programs_per_sm: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from dormant.layers import triton_attention

    monkeypatch.setattr(triton_attention, "PROGRAMS_PER_SM", programs_per_sm)
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


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(32, 8), (16, 2), (32, 4)])
def test_the_splits_merged_by_tickets_match_the_reference(cache_dtype, num_heads, num_kv_heads):
    """The last split program of each (sequence, kv head) merges: the reference's output, and
    every ticket back at 0 (a graph replays on them as they are)."""
    from dormant.layers.attention import new_merge_tickets

    cuda = torch.device("cuda")
    tickets = new_merge_tickets(cuda)
    for _ in range(2):  # the second call draws on the tickets the first left
        error = relative_error(
            DECODE_BATCH, cache_dtype, torch.bfloat16, num_heads, num_kv_heads, 128, 16, cuda,
            kernel="decode", max_seq_len=4096, tickets=tickets,
        )  # fmt: skip
        assert error < tolerance(torch.bfloat16), error
        assert int(tickets.count_nonzero()) == 0


@pytest.mark.parametrize(
    ("programs_per_sm", "tickets"),
    [(8, None), (0, None), (8, 1024), (8, 1)],  # split, merged by a kernel; one split; merged
)  # by tickets; more pairs than tickets: the merge kernel
def test_decode_kernel_in_the_triton_interpreter(programs_per_sm: int, tickets) -> None:
    pytest.importorskip("triton")
    script = (
        "import torch\n"
        "from dormant.layers import triton_attention\n"
        "from tests.layers import test_triton_attention as t\n"
        f"triton_attention.PROGRAMS_PER_SM = {programs_per_sm}\n"
        "options = {}\n"
        f"if {tickets is not None}:\n"
        f"    options['tickets'] = torch.zeros({tickets}, dtype=torch.int32)\n"
        "for *case, max_seq_len in t.INTERPRETER_CASES:\n"
        "    error = t.relative_error(t.SMALL_DECODE_BATCH, *case, torch.device('cpu'),\n"
        "                             kernel='decode', max_seq_len=max_seq_len, **options)\n"
        "    print(case, error)\n"
        "    assert error < t.tolerance(case[1]), (case, error)\n"
        "    assert all(int(x) == 0 for x in options.get('tickets', [])), options\n"
    )
    result = run_interpreted(script, timeout_s=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("\n") == len(INTERPRETER_CASES), result.stdout


def test_the_merge_kernel_and_the_tickets_give_the_same_bits() -> None:
    """Both merge with ``_merge_group``: the same output to the bit, for several split counts,
    a group padded past its heads (6 of 16 rows) and empty splits; the tickets back at 0."""
    pytest.importorskip("triton")
    script = (
        "import dataclasses, torch\n"
        "from dormant.layers.attention import new_merge_tickets\n"
        "from dormant.layers.triton_attention import paged_decode_attention\n"
        "from tests.layers.attention_metadata import build_attention_metadata\n"
        "torch.manual_seed(0)\n"
        "seq_lens = torch.tensor([1, 40, 129, 300], dtype=torch.int32)\n"
        "tables = torch.randperm(4 * 20).view(4, 20).int()\n"
        "cache = torch.randn(2, 80, 16, 2, 16)\n"
        "query = torch.randn(4, 12, 16)\n"
        "meta = build_attention_metadata(tables, seq_lens, torch.ones(4, dtype=torch.int32), 16)\n"
        "meta = dataclasses.replace(meta, max_seq_len=320)\n"
        "one = torch.tensor(1.0)\n"
        "tickets = new_merge_tickets()\n"
        "for splits in (2, 3, 5):\n"
        "    kernel = paged_decode_attention(query, cache, meta, 0.25, one, one,\n"
        "                                    wanted_splits=splits)\n"
        "    fused = paged_decode_attention(query, cache, meta, 0.25, one, one,\n"
        "                                   wanted_splits=splits, tickets=tickets)\n"
        "    assert torch.equal(kernel, fused), (splits, (kernel - fused).abs().max())\n"
        "    assert int(tickets.count_nonzero()) == 0\n"
        "    print('same', splits)\n"
    )
    result = run_interpreted(script, timeout_s=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("same") == 3, result.stdout


def test_a_batch_that_fills_the_gpu_is_not_split() -> None:
    """A 64-position split writes a float32 partial per query head, 12 % of the KV it reads at
    a group of 4 (and a merge reads it back): a batch whose (sequence, kv head) pairs fill the
    SMs reads its whole context in one program each, with no merge."""
    pytest.importorskip("triton")
    from dormant.layers.triton_attention import plan_splits

    assert plan_splits(1, 8, 4096, 132) == (32, 128)  # batch 1: 256 programs over 132 SMs
    assert plan_splits(1, 8, 2048, 132) == (32, 64)
    assert plan_splits(16, 8, 2048, 132) == (8, 256)
    assert plan_splits(512, 8, 2048, 132) == (1, 2048)
    assert plan_splits(132, 8, 2048, 132) == (1, 2048)
    assert plan_splits(1, 8, 100, 132) == (2, 64)  # never more splits than tiles
    for num_seqs in (1, 7, 64, 300):
        splits, length = plan_splits(num_seqs, 2, 3000, 132)
        assert length % 64 == 0 and splits * length >= 3000 > (splits - 1) * length


@pytest.mark.parametrize("tickets", [torch.zeros(64, dtype=torch.int64), torch.zeros(64, 1)])
def test_tickets_of_another_dtype_are_refused_before_any_launch(tickets) -> None:
    pytest.importorskip("triton")
    from dormant.layers.triton_attention import paged_decode_attention
    from tests.layers.attention_metadata import build_attention_metadata

    seq_lens = torch.tensor([5, 9], dtype=torch.int32)
    meta = build_attention_metadata(torch.arange(4).view(2, 2).int(), seq_lens,
                                    torch.ones(2, dtype=torch.int32), 16)  # fmt: skip
    cache, one = torch.randn(2, 4, 16, 2, 16), torch.tensor(1.0)
    with pytest.raises(ValueError, match="int32 merge tickets"):
        paged_decode_attention(torch.randn(2, 4, 16), cache, meta, 0.25, one, one, tickets=tickets)
    assert int(tickets.count_nonzero()) == 0
