"""``worker/cuda_streams.current_stream``: torch's current stream, kept per (device, raw stream).
The CUDA calls are stand-ins here (a raw stream per device that a test switches, as
``torch.cuda.stream(s)`` does); ``tests/gpu/test_cuda_streams_gpu.py`` checks it against torch's
own lookup on a GPU."""

from __future__ import annotations

import pytest
import torch

from dormant.worker import cuda_streams


class FakeCuda:
    """The raw current stream of each device, and torch's lookup counted."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.raw = {0: 0x10, 1: 0x20}
        self.lookups: list[int] = []
        monkeypatch.setattr(cuda_streams, "_kept", {})
        monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", self.raw.get, raising=False)
        monkeypatch.setattr(torch.cuda, "current_stream", self.current_stream)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)

    def current_stream(self, index: int) -> tuple[int, int]:
        self.lookups.append(index)
        return (index, self.raw[index])  # stands for the Stream object of that raw stream


@pytest.fixture
def cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    return FakeCuda(monkeypatch)


def test_the_same_raw_stream_is_looked_up_once(cuda: FakeCuda) -> None:
    first = cuda_streams.current_stream(0)
    assert cuda_streams.current_stream(torch.device("cuda", 0)) is first
    assert first == (0, 0x10) and cuda.lookups == [0]


def test_another_current_stream_is_what_is_returned(cuda: FakeCuda) -> None:
    default = cuda_streams.current_stream(0)
    cuda.raw[0] = 0x30  # as inside ``with torch.cuda.stream(s)``
    assert cuda_streams.current_stream(0) == (0, 0x30)
    cuda.raw[0] = 0x10  # the context left
    assert cuda_streams.current_stream(0) is default
    assert cuda.lookups == [0, 0]


def test_devices_are_kept_apart_and_no_index_is_the_current_device(cuda: FakeCuda) -> None:
    assert cuda_streams.current_stream(torch.device("cuda")) == (1, 0x20)
    assert cuda_streams.current_stream(0) == (0, 0x10)
    assert cuda.lookups == [1, 0]


def test_what_is_kept_is_bounded(cuda: FakeCuda) -> None:
    for raw in range(cuda_streams._MAX_KEPT + 1):  # external streams that come and go
        cuda.raw[0] = 0x1000 + raw
        assert cuda_streams.current_stream(0) == (0, 0x1000 + raw)
    assert len(cuda_streams._kept) == 1
