"""Under MPS, ``sleep(level, release_context=True)`` is refused before anything changes: the
driver cannot checkpoint an MPS client (its lock answers CUDA_ERROR_NOT_SUPPORTED, once the tags
have slept). The check runs in a process that is an MPS client, and checks NVML lists it as one:
under ``scripts/with_mps.sh`` (the ``mps`` stage of ``scripts/gpu_suite.sh``) it runs in place;
elsewhere the launcher test runs it in a child under its own private MPS daemon, so the plain GPU
suite covers it wherever ``nvidia-cuda-mps-control`` exists."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dormant import LLM, SamplingParams
from dormant.memory import CheckpointUnsupportedError, nvml
from dormant.memory.context_release import reaches_mps_pipe
from dormant.memory.residual import pci_bus_id_of
from tests.engine.conftest import PROMPTS, write_checkpoint
from tests.gpu.conftest import make_engine

pytestmark = pytest.mark.gpu
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
ROOT = Path(__file__).resolve().parents[2]
UNDER_MPS = reaches_mps_pipe()  # a private daemon's pipe, or a machine-wide one's default


def tokens(llm: LLM) -> list[tuple[int, ...]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_release_context_is_refused_under_mps(engines, tmp_path) -> None:
    if not UNDER_MPS:
        pytest.skip("not under MPS: test_the_check_runs_under_a_private_mps_daemon runs it")
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


def test_the_check_runs_under_a_private_mps_daemon() -> None:
    """The test above, in a child pytest under ``scripts/with_mps.sh``: the daemon's pipe folder is
    private, so this process (not a client) and the child share the GPU in its default mode."""
    if UNDER_MPS:
        pytest.skip("already under MPS: the test above runs in place")
    if shutil.which("nvidia-cuda-mps-control") is None:
        pytest.skip("nvidia-cuda-mps-control is not on this machine")
    test = f"{Path(__file__).relative_to(ROOT)}::test_release_context_is_refused_under_mps"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", test]
    # `timeout` sends TERM, which the script passes on before it quits the daemon; a SIGKILL
    # (subprocess.run's own timeout, the backstop) would leave both running.
    result = subprocess.run(
        ["timeout", "300", "bash", str(ROOT / "scripts" / "with_mps.sh"), *command],
        cwd=ROOT, capture_output=True, text=True, timeout=360, check=False,
    )  # fmt: skip
    report = result.stdout[-3000:] + result.stderr[-2000:]
    assert result.returncode == 0, report
    assert "1 passed" in result.stdout, report  # it ran, not skipped
    assert "clients: 0" not in result.stderr, report  # the child was the daemon's client
