"""The driver's process checkpoint on this machine, alone: what ``sleep(release_context=True)``
builds on (``dormant.memory.process_checkpoint``), without the engine.

A child process creates its CUDA context, fills ``--gib`` GiB of device memory with a pattern,
and waits. This process (which never touches CUDA) checkpoints it through the helper (lock +
checkpoint), reads NVML, restores it (restore + unlock), and the child checks its pattern bit
for bit. Each operation has its own timeout, so a driver that hangs is reported with the
operation it hung in, and the child's Python stacks are dumped by ``faulthandler`` meanwhile.

Usage: python benchmarks/context_release.py [--gib 0 1 8] [--out results.jsonl]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import Recorder, environment  # noqa: E402

GiB = 1 << 30


def measure(gib: float, timeout_s: float) -> dict[str, Any]:
    from dormant.memory import nvml
    from dormant.memory.process_checkpoint import ProcessCheckpoint

    child = subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), "--child", str(gib)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT,
    )  # fmt: skip
    assert child.stdin is not None and child.stdout is not None
    row: dict[str, Any] = {"case": "checkpoint", "gib": gib}
    try:
        ready = json.loads(child.stdout.readline())
        bus, pid = ready["pci_bus_id"], child.pid
        row["process_bytes_awake"] = nvml.process_memory(bus, pid)
        checkpoint = ProcessCheckpoint(pid, lock_timeout_s=timeout_s, reply_timeout_s=timeout_s)
        row["state_before"] = str(checkpoint.probe())
        row["lock_and_checkpoint_s"] = checkpoint.checkpoint()
        row["state_checkpointed"] = str(checkpoint.state())
        row["process_bytes_checkpointed"] = nvml.process_memory(bus, pid)
        row["restore_and_unlock_s"] = checkpoint.restore()
        row["state_after"] = str(checkpoint.state())
        checkpoint.close()
        child.stdin.write("check\n")
        child.stdin.flush()
        row.update(json.loads(child.stdout.readline()))
    except Exception as error:  # reported in the row: the next size still runs
        row["error"] = f"{type(error).__name__}: {error}"
    finally:
        child.kill()
        child.wait()
    return row


def child_main(gib: float) -> None:
    import faulthandler

    import torch

    from dormant.memory.residual import pci_bus_id_of

    faulthandler.dump_traceback_later(30, repeat=True)  # stderr: where a hang sits
    torch.cuda.init()
    n = int(gib * GiB) // 8
    data = torch.arange(n, dtype=torch.int64, device="cuda") * 2654435761
    torch.cuda.synchronize()
    print(json.dumps({"pci_bus_id": pci_bus_id_of(0)}), flush=True)
    sys.stdin.readline()
    start = time.perf_counter()
    expected = torch.arange(n, dtype=torch.int64, device="cuda") * 2654435761
    equal = bool(torch.equal(data, expected))
    first_call_s = time.perf_counter() - start
    print(json.dumps({"bit_exact": equal, "first_calls_after_restore_s": first_call_s}), flush=True)


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child_main(float(sys.argv[2]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, nargs="+", default=[0.0, 1.0, 8.0])
    parser.add_argument("--timeout-s", type=float, default=60.0, help="per operation")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rec = Recorder(args.out)
    os.environ["PYTHONPATH"] = f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    for gib in args.gib:
        rec.emit(**measure(gib, args.timeout_s))
    rec.emit(case="environment", **environment())  # last: no CUDA context here before it


if __name__ == "__main__":
    main()
