"""The GPU content hash against a numpy transcription of its formula (cuda_hash's docstring),
run on the CPU through Triton's interpreter, in a subprocess (``TRITON_INTERPRET`` is read when
triton is imported). The GPU runs the same kernels in tests/memory/test_unchanged.py."""

from __future__ import annotations

import numpy as np
import pytest

from tests.triton_interpreter import run_interpreted


def fmix32(h: np.ndarray) -> np.ndarray:
    h = h ^ (h >> 16)
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def reference_digest(words: np.ndarray) -> bytes:
    """The 128-bit digest of one span of uint32 words: four lane sums mod 2^32."""
    position = np.arange(len(words), dtype=np.uint64)
    p = position.astype(np.uint32) ^ ((position >> np.uint64(32)).astype(np.uint32) * 0x85EBCA77)
    h = fmix32(words ^ (p * np.uint32(0x9E3779B1)))
    odd = np.uint32(1)
    lanes = [
        h,
        h * ((p * np.uint32(0x85EBCA77) + np.uint32(0x165667B1)) | odd),
        words * ((p * np.uint32(0xC2B2AE3D) + np.uint32(0x27D4EB2F)) | odd),
        (h ^ words) * ((p * np.uint32(0x61C88647) + np.uint32(0x2545F491)) | odd),
    ]
    return np.array([lane.sum(dtype=np.uint32) for lane in lanes], dtype=np.uint32).tobytes()


SCRIPT = """
import numpy as np, torch
from dormant.memory import cuda_hash
from dormant.memory.backend import Span
from tests.memory.test_cuda_hash import reference_digest

cuda_hash.SPAN_SUM_BLOCK = 2  # several steps of the span-sum loop on small spans
torch.manual_seed(0)
data = torch.randint(-(2**31), 2**31 - 1, (400_000,), dtype=torch.int32)
words = data.numpy().view(np.uint32)
# (first word, number of words): one 16-byte span, programs of 64 KiB cut mid-span, 5 programs
layout = [(0, 4), (16, 1024), (2048, 70_000), (100_000, 81_920), (300_000, 4)]
spans = [Span(data.data_ptr() + 4 * first, 4 * n) for first, n in layout]
digests = cuda_hash.hash_spans(spans, torch.device("cpu"), base=data)
assert digests == [reference_digest(words[f : f + n]) for f, n in layout]
data[2048 + 69_999] ^= 1  # one bit of the last word of the third span
after = cuda_hash.hash_spans(spans, torch.device("cpu"), base=data)
assert [a != b for a, b in zip(after, digests)] == [False, False, True, False, False]
# Many spans, and one: the same compiled search (a fixed number of steps) finds every span.
# 130 spans take 8 steps of the search (the interpreter runs each program in Python: 1000
# spans took 4 minutes of CI).
many = [Span(data.data_ptr() + 64 * i, 48) for i in range(130)]
pending = [cuda_hash.start_hashes(group, torch.device("cpu"), base=data)
           for group in (many, many[100:101], many[:17])]
expected = [reference_digest(words[16 * i : 16 * i + 12]) for i in range(130)]
assert [p.result() for p in pending] == [expected, expected[100:101], expected[:17]]
print("hash: ok")
"""


def test_hash_kernels_match_the_formula_in_the_interpreter() -> None:
    pytest.importorskip("triton")
    result = run_interpreted(SCRIPT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "hash: ok" in result.stdout


def test_reference_detects_a_swap() -> None:
    words = np.arange(64, dtype=np.uint32)
    swapped = words.copy()
    swapped[[3, 40]] = swapped[[40, 3]]
    assert reference_digest(words) != reference_digest(swapped)
