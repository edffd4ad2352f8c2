"""Where the CUDA IPC refit's receiver spends its time, per bucket: rebuilding the handle,
unflattening, validating, copying, synchronizing. A second process sends the 8B-like model's
bf16 weights in flattened buckets (``benchmarks/refit.py``'s sender); prints one JSON line per
stage with its median milliseconds per bucket.

    python benchmarks/ipc_stages.py [--bucket-mib 512] [--out stages.jsonl]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from multiprocessing import get_context
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import MiB, Recorder
from benchmarks.decode import QWEN3_8B_LIKE
from benchmarks.refit import build, sender_main
from dormant.models import ModelConfig
from dormant.worker.ipc_weights import deserialize_payload, unflatten_bucket

STAGES = ("rebuild", "unflatten", "check", "copy", "sync")
# Also timed: "release", dropping the rebuilt tensors (closing the IPC handle), and "sender",
# from the acknowledgement to the next bucket's arrival (the trainer packing and serializing).


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--bucket-mib", type=int, default=512)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    model = build(ModelConfig.from_dict(QWEN3_8B_LIKE), device)
    shapes = {n: tuple(s) for n, s in model.expected_weight_shapes().items()}
    recorder = Recorder(args.out)
    for mode in ("new", "reuse"):
        conn, child = get_context("spawn").Pipe()
        sender = get_context("spawn").Process(
            target=sender_main, args=(child, shapes, "cuda", args.bucket_mib * MiB, 3, mode)
        )
        sender.start()
        conn.recv()
        stages: dict[str, list[float]] = {k: [] for k in (*STAGES, "release", "sender")}
        for _ in range(3):
            conn.send("run")
            acknowledged = None
            while (entries := conn.recv()) is not None:
                t0 = time.perf_counter()
                if acknowledged is not None:
                    stages["sender"].append(t0 - acknowledged)
                payload = deserialize_payload(entries[0])
                t1 = time.perf_counter()
                named = unflatten_bucket(payload)
                t2 = time.perf_counter()
                model.check_weights([(n, t.shape, t.dtype) for n, t in named])
                t3 = time.perf_counter()
                model.load_weights(named)
                t4 = time.perf_counter()
                torch.cuda.synchronize()
                t5 = time.perf_counter()
                for key, value in zip(
                    STAGES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4), strict=True
                ):
                    stages[key].append(value)
                del payload, named
                stages["release"].append(time.perf_counter() - t5)
                conn.send(True)
                acknowledged = time.perf_counter()
        conn.send("stop")
        sender.join()
        for stage, values in stages.items():
            recorder.emit(
                case="ipc receiver stage", sender=mode, stage=stage, buckets=len(values),
                median_ms=statistics.median(values) * 1e3, max_ms=max(values) * 1e3,
            )  # fmt: skip


if __name__ == "__main__":
    main()
