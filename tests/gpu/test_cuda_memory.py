"""The cuda backend on a real GPU: graphs over pool memory, OOM on wake, driver threads.

(Every backend-generic test in tests/memory also runs here, parametrized on ``cuda``.)
"""

from __future__ import annotations

import gc
import threading

import pytest
import torch

from dormant.memory import MemoryManager, WakeOutOfMemoryError
from tests.memory.helpers import random_fill, same_bytes

pytestmark = pytest.mark.gpu
MiB = 1 << 20


def capture_linear(mm: MemoryManager) -> tuple[torch.cuda.CUDAGraph, dict[str, torch.Tensor]]:
    """A graph computing y = tanh(x @ w) over pool tensors: weights, runtime input, scratch out."""
    w = mm.empty((512, 512), torch.float32, "weights")
    x = mm.empty((64, 512), torch.float32, "runtime")
    y = mm.empty((64, 512), torch.float32, "workspace")
    torch.manual_seed(0)
    w.copy_(torch.randn(512, 512, device="cuda") / 16)
    x.copy_(torch.randn(64, 512, device="cuda"))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up cuBLAS outside the capture
        torch.tanh(torch.matmul(x, w), out=y)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.tanh(torch.matmul(x, w), out=y)
    return graph, {"w": w, "x": x, "y": y}


def test_graph_replays_bit_exact_after_level_1(cuda_mm: MemoryManager) -> None:
    graph, t = capture_linear(cuda_mm)
    graph.replay()
    expected = t["y"].clone()
    addresses = [v.data_ptr() for v in t.values()]
    for _ in range(3):
        cuda_mm.sleep(level=1)
        assert cuda_mm.status().tag("weights").mapped_bytes == 0
        cuda_mm.wake_up()
        t["y"].zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(t["y"], expected)
    assert [v.data_ptr() for v in t.values()] == addresses


def test_graph_gives_nan_after_level_2_until_weights_are_refit(cuda_mm: MemoryManager) -> None:
    graph, t = capture_linear(cuda_mm)
    graph.replay()
    expected = t["y"].clone()
    saved_w = t["w"].clone()
    cuda_mm.sleep(level=2)
    cuda_mm.wake_up()  # every tag mapped again (replaying over unmapped memory would fault)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.isnan(t["y"]).all()  # poison: the discarded weights fail loudly
    t["w"].copy_(saved_w)  # refit in place
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(t["y"], expected)


def test_wake_oom_rolls_back_on_the_gpu(cuda_mm: MemoryManager) -> None:
    w = cuda_mm.empty((512 * MiB,), torch.uint8, "weights")
    kv = cuda_mm.empty((1024 * MiB,), torch.uint8, "kv_cache")
    expected = random_fill(w, 1)
    cuda_mm.sleep(level=1)
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    trainer = torch.empty(free - 1024 * MiB, dtype=torch.uint8, device="cuda")  # leaves 1 GiB
    before = torch.cuda.mem_get_info()[0]
    with pytest.raises(WakeOutOfMemoryError) as caught:
        cuda_mm.wake_up()
    assert caught.value.bytes_requested >= 1536 * MiB
    assert abs(torch.cuda.mem_get_info()[0] - before) < 64 * MiB  # nothing left mapped
    assert cuda_mm.is_sleeping("weights") and cuda_mm.is_sleeping("kv_cache")
    del trainer
    torch.cuda.empty_cache()
    cuda_mm.wake_up()
    assert same_bytes(w, expected)
    del kv


def test_driver_calls_work_from_other_threads(cuda_mm: MemoryManager) -> None:
    w = cuda_mm.empty((8 * MiB,), torch.uint8, "weights")
    expected = random_fill(w, 2)
    errors: list[BaseException] = []

    def cycle() -> None:
        try:
            cuda_mm.sleep(level=1)
            cuda_mm.wake_up()
            extra = cuda_mm.empty((4 * MiB,), torch.uint8, "workspace")
            del extra
            gc.collect()
        except BaseException as error:
            errors.append(error)

    thread = threading.Thread(target=cycle)
    thread.start()
    thread.join()
    assert not errors, errors
    assert same_bytes(w, expected)


def test_status_explains_the_residual(cuda_mm: MemoryManager) -> None:
    w = cuda_mm.empty((64 * MiB,), torch.uint8, "weights")
    cuda_mm.sleep(level=1)
    status = cuda_mm.status()
    owners = {r.owner: r.nbytes for r in status.residual}
    assert not any("weights" in owner for owner in owners)
    assert any("CUDA context" in owner for owner in owners)
    assert status.device_used_bytes == sum(owners.values())
    assert "device memory in use, by owner" in status.table()
    cuda_mm.wake_up()
    del w
