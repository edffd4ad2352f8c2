"""The context's local memory on the H200: a sleep gives it back (the stack limit 0 while
asleep, the freed bytes reported), torch's and Triton's kernels and cuBLAS GEMMs run correctly
while it is released (a colocated trainer's work), and after the wake the limit is the one the
graphs were captured with and the engine's tokens are identical (FULL + fused multi-step graphs,
levels 1 and 2)."""

from __future__ import annotations

import pytest
import torch

from dormant import LLM, SamplingParams
from dormant.memory.local_memory import _stack_limit
from tests.engine.conftest import PROMPTS, write_checkpoint
from tests.gpu.conftest import make_engine

pytestmark = pytest.mark.gpu
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory):
    return write_checkpoint(tmp_path_factory.mktemp("local_memory_ckpt"), seed=1)


def tokens(llm: LLM) -> list[tuple[int, ...]]:
    out = llm.generate(PROMPTS, GREEDY) + llm.generate(PROMPTS, SEEDED)
    return [o.outputs[0].token_ids for o in out]


def trainer_work() -> None:
    """Kernels of every kind a trainer runs, checked against the host."""
    from dormant.layers.triton_norm import rms_norm

    a = torch.randn(256, 512, device="cuda", dtype=torch.float32)
    b = torch.randn(512, 128, device="cuda", dtype=torch.float32)
    torch.testing.assert_close((a @ b).cpu(), a.cpu() @ b.cpu(), rtol=1e-3, atol=1e-3)
    torch.testing.assert_close((a * 2 + 1).cpu(), a.cpu() * 2 + 1)
    x = torch.randn(8, 256, device="cuda", dtype=torch.bfloat16)
    weight = torch.ones(256, device="cuda", dtype=torch.bfloat16)
    reference = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
    normed, _ = rms_norm(x, weight, 1e-6)
    torch.testing.assert_close(normed.float(), reference, rtol=2e-2, atol=2e-2)
    torch.cuda.synchronize()


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_gives_the_local_memory_back_and_the_wake_restores_it(
    engines, checkpoint, level: int
) -> None:
    llm = make_engine(engines, checkpoint, cuda_graph_multi_steps=4)
    before, limit = tokens(llm), _stack_limit()
    llm.sleep(level=level)
    status = llm.memory_status()[0]
    print(status)
    released = {item.owner: item.nbytes for item in status.released}
    freed = released["the context's local memory (thread stacks), last sleep"]
    assert freed > 0 and _stack_limit() == 0
    trainer_work()  # while released: the driver grows what a launch needs
    llm.wake_up(["weights"])
    if level == 2:
        llm.collective_rpc("reload_weights")
    llm.wake_up()
    assert _stack_limit() == limit
    assert tokens(llm) == before
