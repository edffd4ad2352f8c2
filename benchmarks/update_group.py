"""Issue 20's weight-update group: a trainer on its own GPU broadcasts new weights to the engine's
TP ranks (SGLang's ``init_weights_update_group`` / ``update_weights_from_distributed``), against
a plain broadcast of the same bytes over the same group.

On GPUs (NCCL) the engine's ranks are on GPUs 0..N-1 and the trainer, rank 0 of the group, on
GPU N (default: N = the largest power of two below the visible GPUs, so that it divides the
heads: TP=2 on four GPUs). The trainer makes seeded random weights under
the model's HF names (on the CPU, then on its GPU, so that the driver can make the same bytes)
and, per repeat:
  - refit: broadcasts them tensor by tensor (``load_format=None``) while the engine receives
    them into its weights (the driver's wall time of ``update_weights_from_distributed``);
  - plain: broadcasts one buffer of the same bytes while every engine rank receives it into a
    buffer of its own (a ``collective_rpc`` callable on the group), with nothing written.
GB/s is weight bytes over each median. Checked: the tokens after the broadcast refit equal the
tokens after the same weights written in-process (``update_weights``), and differ from the
tokens before. ``--tiny`` runs a tiny model at TP=2 on the CPU over gloo, which checks the
script, not the figures.

    python benchmarks/update_group.py [--tp N] [--layers 12] [--repeats 3] [--tiny] [--out F]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from multiprocessing import get_context
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import Recorder, table
from benchmarks.decode import QWEN3_8B_LIKE
from benchmarks.tp_scenario import GREEDY, PROMPTS, TINY
from dormant import LLM
from dormant.executors.multiproc import free_port
from dormant.models import ModelConfig, build_model
from dormant.worker.update_group import broadcast_weights, create_update_group

GROUP = "bench_update_group"
Specs = list[tuple[str, tuple[int, ...]]]


def new_weights(specs: Specs, dtype: torch.dtype, seed: int) -> list[tuple[str, torch.Tensor]]:
    """Seeded random weights on the CPU: small matrices, norms near one."""
    generator = torch.Generator().manual_seed(seed)
    weights = []
    for name, shape in specs:
        values = torch.randn(shape, generator=generator)
        values = 1 + 0.1 * values if "norm" in name else 0.02 * values
        weights.append((name, values.to(dtype)))
    return weights


def trainer(conn: Connection, port: int, world_size: int, device: str, backend: str) -> None:
    """Rank 0 of the group: on "refit" broadcasts the weights tensor by tensor, on "plain" one
    buffer of the same bytes; each answered with its seconds, until "stop"."""
    specs, dtype, seed = conn.recv()
    group = create_update_group("127.0.0.1", port, 0, world_size, GROUP, backend)
    weights = [(n, t.to(device)) for n, t in new_weights(specs, dtype, seed)]
    flat = torch.empty(sum(t.numel() * t.element_size() for _, t in weights), dtype=torch.uint8,
                       device=device)  # fmt: skip
    options = dist.BroadcastOptions()
    options.rootRank = 0
    while (command := conn.recv()) != "stop":
        start = time.perf_counter()
        if command == "refit":
            broadcast_weights(group, weights, timeout_s=600)
        else:
            group.broadcast([flat], options).wait()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        conn.send(time.perf_counter() - start)
    dist.destroy_process_group(group)


def plain_receive(worker: Any, group_name: str, nbytes: int) -> float:
    """An engine rank's side of the plain broadcast (a ``collective_rpc`` callable)."""
    group = worker.refitter.groups.group(group_name)
    buffer = torch.empty(nbytes, dtype=torch.uint8, device=worker.device)
    options = dist.BroadcastOptions()
    options.rootRank = 0
    start = time.perf_counter()
    group.broadcast([buffer], options).wait()
    if buffer.is_cuda:
        torch.cuda.synchronize(buffer.device)
    return time.perf_counter() - start


def tokens(llm: LLM) -> list[tuple[int, ...]]:
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=None, help="engine ranks (default: see above)")
    parser.add_argument("--layers", type=int, default=12, help="the 8B-like model's layers")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="a tiny model at TP=2 on the CPU")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    on_gpu = not args.tiny
    spare = torch.cuda.device_count() - 1  # the GPUs beside the trainer's
    tp = args.tp or (1 << (spare.bit_length() - 1) if on_gpu and spare > 0 else 2)
    if on_gpu and tp >= torch.cuda.device_count():
        raise SystemExit(f"TP={tp} leaves no GPU for the trainer ({torch.cuda.device_count()})")
    base = {**QWEN3_8B_LIKE, "num_hidden_layers": args.layers}
    if args.tiny:
        base = {**QWEN3_8B_LIKE, **TINY, "num_hidden_layers": 2}
    config = ModelConfig.from_dict(base)
    with torch.device("meta"):
        specs = [(n, tuple(s)) for n, s in build_model(config).expected_weight_shapes().items()]
    weights = new_weights(specs, config.dtype, seed=7)
    nbytes = sum(t.numel() * t.element_size() for _, t in weights)
    recorder = Recorder(args.out)
    backend, device = ("nccl", f"cuda:{tp}") if on_gpu else ("gloo", "cpu")
    recorder.emit(case="setup", tp=tp, backend=backend, trainer_device=device,
                  weight_bytes=nbytes, num_tensors=len(specs), torch=torch.__version__)  # fmt: skip
    options = {"device": "cpu", "enforce_eager": True} if args.tiny else {"device": "cuda"}
    llm = LLM(config, tensor_parallel_size=tp, max_model_len=256, max_num_seqs=8,
              kv_cache_memory_bytes=64 << 20, skip_tokenizer_init=True, **options)  # fmt: skip
    context = get_context("spawn")
    conn, child = context.Pipe()
    port = free_port()
    process = context.Process(target=trainer, args=(child, port, tp + 1, device, backend))
    process.start()
    try:
        before = tokens(llm)
        conn.send((specs, config.dtype, 7))
        llm.init_weights_update_group("127.0.0.1", port, 1, tp + 1, GROUP, backend=backend)
        names, shapes = [n for n, _ in specs], [list(s) for _, s in specs]
        dtypes = [str(config.dtype)] * len(specs)
        times: dict[str, list[float]] = {"refit": [], "plain": [], "trainer refit": []}
        for _ in range(args.repeats):
            conn.send("refit")
            start = time.perf_counter()
            llm.update_weights_from_distributed(names, dtypes, shapes, GROUP)
            times["refit"].append(time.perf_counter() - start)
            times["trainer refit"].append(conn.recv())
            conn.send("plain")
            start = time.perf_counter()
            llm.collective_rpc(plain_receive, args=(GROUP, nbytes))
            times["plain"].append(time.perf_counter() - start)
            conn.recv()
        refitted = tokens(llm)
        llm.destroy_weights_update_group(GROUP)
        conn.send("stop")
        llm.update_weights(weights)
        reference = tokens(llm)
    finally:
        process.join(timeout=60)
        if process.is_alive():
            process.kill()
        llm.shutdown()
    rows = [
        recorder.emit(case=case, seconds=statistics.median(values), min_s=min(values),
                      max_s=max(values), gbps=nbytes / statistics.median(values) / 1e9)
        for case, values in times.items()
    ]  # fmt: skip
    ratio = rows[1]["seconds"] / rows[0]["seconds"]
    recorder.emit(case="check", tokens_equal_in_process_refit=refitted == reference,
                  tokens_changed=refitted != before, refit_of_plain=ratio)  # fmt: skip
    print(table(rows, ["case", "seconds", "gbps"]))
    if refitted != reference or refitted == before:
        raise SystemExit("the broadcast refit's tokens differ from the in-process refit's")


if __name__ == "__main__":
    main()
