"""Under MPS, ``sleep(level, release_context=True)`` is refused before anything changes: the
driver cannot checkpoint an MPS client (its lock answers CUDA_ERROR_NOT_SUPPORTED, once the tags
have slept). Runs only in a process that is an MPS client (``scripts/with_mps.sh``; the
``mps`` stage of ``scripts/gpu_suite.sh``), and checks NVML lists it as one."""

from __future__ import annotations

import os

import pytest
import torch

from dormant import LLM, SamplingParams
from dormant.memory import CheckpointUnsupportedError, nvml
from dormant.memory.residual import pci_bus_id_of
from tests.engine.conftest import PROMPTS, write_checkpoint
from tests.gpu.conftest import make_engine

pytestmark = pytest.mark.gpu
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def tokens(llm: LLM) -> list[tuple[int, ...]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_release_context_is_refused_under_mps(engines, tmp_path) -> None:
    if not os.environ.get("CUDA_MPS_PIPE_DIRECTORY"):
        pytest.skip("not under MPS: run it through scripts/with_mps.sh")
    llm = make_engine(engines, write_checkpoint(tmp_path, seed=1), enable_sleep_mode=True)
    bus = pci_bus_id_of(torch.cuda.current_device())
    assert bus is not None
    clients = nvml.mps_clients(bus)
    assert clients is not None and os.getpid() in clients, clients  # NVML sees the client
    before = tokens(llm)
    with pytest.raises(CheckpointUnsupportedError, match="MPS"):
        llm.sleep(level=2, release_context=True)
    assert not llm.is_sleeping()
    assert tokens(llm) == before
    llm.sleep(level=1)  # without release_context it sleeps as ever
    assert llm.wake_up()
    assert tokens(llm) == before
