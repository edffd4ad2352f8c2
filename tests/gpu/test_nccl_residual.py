"""The NCCL communicator in ``memory_status().residual`` (issue 20), on one GPU: an NCCL world of
one rank in a fresh subprocess, a worker-style ``create_communicator`` between two marks, and its
row is measured (more than zero) and separate from the context's."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

PROBE = textwrap.dedent(
    """
    import json, sys
    import torch, torch.distributed as dist
    from dormant.distributed.communicator import NCCL_OWNER, create_communicator
    from dormant.distributed.parallel_state import DistributedTPGroup
    from dormant.memory import MemoryManager

    torch.cuda.set_device(0)
    mm = MemoryManager("cuda")
    # no device_id: as in the engine's workers, torch makes the communicator lazily
    dist.init_process_group("nccl", init_method="file://" + sys.argv[1], rank=0, world_size=1)
    group = DistributedTPGroup()
    made = create_communicator(group, mm.residual)
    status = mm.status()
    rows = {r.owner: r.nbytes for r in status.residual}
    again = create_communicator(group, mm.residual)  # made already: its second row is ~0
    print(json.dumps({"made": made, "again": again, "rows": rows, "nccl_owner": NCCL_OWNER,
                      "text": status.table()}))
    dist.destroy_process_group()
    """
)


def test_the_communicator_is_its_own_measured_row(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, str(tmp_path / "rendezvous")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    print(result["text"])
    assert result["made"]
    nccl = [n for owner, n in result["rows"].items() if owner.startswith(result["nccl_owner"])]
    assert len(nccl) == 1 and nccl[0] > 0, result["rows"]
    assert result["again"]  # a second call is harmless: the communicator exists
