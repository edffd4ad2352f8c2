"""``byte_copy`` on the CPU: the word a byte range is copied in, and the fallback to ``copy_``
(the SM path itself runs on the GPU: tests/gpu/test_byte_copy_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from dormant.worker import byte_copy


@pytest.mark.parametrize(
    ("offset", "nbytes", "word"),
    [(0, 64, torch.int32), (4, 60, torch.int32), (2, 64, torch.int16), (0, 62, torch.int16),
     (1, 64, None), (0, 63, None)],
)  # fmt: skip
def test_the_word_is_the_widest_both_ranges_align_to(offset, nbytes, word) -> None:
    base = torch.zeros(256, dtype=torch.uint8)
    assert base.data_ptr() % 16 == 0
    dst, src = base[offset : offset + nbytes], base[128 + offset : 128 + offset + nbytes]
    assert byte_copy.word_dtype(dst, src) == word


def test_a_misaligned_source_takes_the_narrower_word() -> None:
    base = torch.zeros(256, dtype=torch.uint8)
    assert byte_copy.word_dtype(base[0:64], base[130:194]) == torch.int16  # src 2 bytes off
    assert byte_copy.word_dtype(base[0:64], base[129:193]) is None


def test_cpu_tensors_are_copied_by_copy_even_with_sm_copies_on(monkeypatch) -> None:
    monkeypatch.setattr(byte_copy, "SM_COPIES", True)
    calls = []
    monkeypatch.setattr(torch, "bitwise_or", lambda *a, **k: calls.append(a))
    src = torch.randint(0, 256, (100,), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    byte_copy.copy_bytes(dst, src)
    assert torch.equal(dst, src) and not calls
