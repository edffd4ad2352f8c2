"""``worker/cuda_streams.current_stream`` on a GPU: torch's current stream, outside and inside
``torch.cuda.stream(s)`` (a pool stream and an external one), and a synchronize on it waits for
the work queued on that stream."""

from __future__ import annotations

import pytest
import torch

from dormant.worker.cuda_streams import current_stream

pytestmark = pytest.mark.gpu


def test_it_is_torchs_current_stream_in_every_context() -> None:
    torch.cuda.init()
    assert current_stream(0) == torch.cuda.current_stream(0)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        assert current_stream(0) == side == torch.cuda.current_stream(0)
        assert current_stream(torch.device("cuda")) == side
    assert current_stream(0) == torch.cuda.default_stream(0) == torch.cuda.current_stream(0)
    external = torch.cuda.ExternalStream(torch.cuda.Stream().cuda_stream)
    with torch.cuda.stream(external):
        assert current_stream(0).cuda_stream == external.cuda_stream


def test_its_synchronize_waits_for_the_streams_work() -> None:
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        x = torch.randn(4096, 4096, device="cuda")
        done = torch.cuda.Event()
        for _ in range(20):
            x = x @ x / 64
        done.record()
        current_stream(0).synchronize()
        assert done.query()
