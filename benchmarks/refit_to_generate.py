"""From "the trainer has the new weights" to "the engine generates with them", on the 8B-like
model (random bf16 weights, ~16 GB), colocated on one GPU, stage by stage.

The engine sleeps at level 2 (weights and KV discarded, as between rollouts). Then, timed from
the moment the trainer (a second process) holds the new weights:
  1. ``wake_up(["weights"])`` maps the weight memory back (nothing to copy at level 2);
  2. the refit: CUDA IPC flattened buckets through ``update_weights_from_tensor``, the trainer
     packing each bucket as slime does;
  3. ``wake_up()`` the rest (KV cache, graphs' memory);
  4. ``generate``: one prompt, one token, greedy; every cycle must give the same token.
One JSON line per cycle with each stage's seconds, and the device-to-device limit of the bytes.

Usage: python benchmarks/refit_to_generate.py [--out results.jsonl] [--cycles 3] [--bucket-mib 512]
"""

from __future__ import annotations

import argparse
import sys
import time
from multiprocessing import get_context
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import MiB, Recorder, table
from benchmarks.decode import QWEN3_8B_LIKE
from benchmarks.refit import copy_limit, sender_main
from dormant import LLM, SamplingParams
from dormant.models import ModelConfig
from dormant.worker.ipc_weights import FLATTENED_BUCKET

PROMPT = {"prompt_token_ids": list(range(100, 164))}
ONE_TOKEN = SamplingParams(temperature=0.0, max_tokens=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--cycles", type=int, default=3)
    parser.add_argument("--bucket-mib", type=int, default=512)
    args = parser.parse_args()
    rec = Recorder(args.out)
    llm = LLM(
        ModelConfig.from_dict(QWEN3_8B_LIKE),
        max_model_len=4096,
        max_num_seqs=64,
        gpu_memory_utilization=0.5,
        enable_sleep_mode=True,
    )
    model = llm.llm_engine.executor.worker.model
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    shapes = {n: tuple(s) for n, s in model.expected_weight_shapes().items()}
    limit_s = min(copy_limit(weight_bytes, torch.device("cuda"), 3)[0])
    ctx = get_context("spawn")
    conn, child = ctx.Pipe()
    sender = ctx.Process(
        target=sender_main,
        args=(child, shapes, "cuda", args.bucket_mib * MiB, 7, "new"),
    )
    sender.start()
    conn.recv()  # the trainer holds its weights
    llm.generate([PROMPT], ONE_TOKEN, use_tqdm=False)  # warm
    rows, expected = [], None
    for cycle in range(args.cycles):
        llm.sleep(level=2)
        start = time.perf_counter()
        llm.wake_up(["weights"])
        woke_weights = time.perf_counter()
        conn.send("run")
        while (entries := conn.recv()) is not None:
            llm.update_weights_from_tensor(entries, load_format=FLATTENED_BUCKET)
            conn.send(True)
        refitted = time.perf_counter()
        llm.wake_up()
        woke_rest = time.perf_counter()
        token = llm.generate([PROMPT], ONE_TOKEN, use_tqdm=False)[0].outputs[0].token_ids[0]
        generated = time.perf_counter()
        expected = token if expected is None else expected
        rows.append(
            rec.emit(
                case="trainer has weights -> engine generates",
                cycle=cycle,
                wake_weights_s=woke_weights - start,
                refit_s=refitted - woke_weights,
                wake_rest_s=woke_rest - refitted,
                first_token_s=generated - woke_rest,
                total_s=generated - start,
                refit_x_limit=(refitted - woke_weights) / limit_s,
                limit_s=limit_s,
                weight_bytes=weight_bytes,
                bucket_mib=args.bucket_mib,
                same_token=token == expected,
            )
        )
    conn.send("stop")
    sender.join()
    llm.shutdown()
    columns = ["cycle", "wake_weights_s", "refit_s", "wake_rest_s", "first_token_s", "total_s"]
    print(table(rows, columns))


if __name__ == "__main__":
    main()
