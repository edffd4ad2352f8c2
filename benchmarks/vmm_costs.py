# ruff: noqa: B023  (the closures below are called at once, inside their loop iteration)
"""Where the time goes under a sleep: VMM driver calls, host-arena setup, content-hash kernels.

A probe, not a comparison: it times the building blocks dormant's sleep and wake are made of, so
that design choices rest on measurements (see RESULTS.md).

Usage: python benchmarks/vmm_costs.py [--out results.jsonl]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import GiB, MiB, Recorder, environment
from dormant.memory import libc
from dormant.memory.cuda_backend import CudaBackend
from dormant.memory.cuda_hash import _fmix32


def clock(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def probe_vmm(rec: Recorder, backend: CudaBackend) -> None:
    """create / map / unmap / release of the same bytes: one handle or many, serial or threaded."""
    for total, count, threads in [
        (32 * GiB, 1, 1),
        (32 * GiB, 16, 1),
        (32 * GiB, 16, 4),
        (8 * GiB, 1, 1),
        (8 * GiB, 4096, 1),
        (8 * GiB, 4096, 4),
    ]:
        size = total // count
        vas = [backend.reserve(size) for _ in range(count)]
        row = {}
        for _ in range(2):  # the second round is the one reported (warm driver)
            handles: list[int] = []
            row["create_s"] = clock(lambda: handles.extend(backend.create(size) for _ in vas))
            pairs = list(zip(vas, handles, strict=True))

            def run(fn, items):
                if threads == 1:
                    for item in items:
                        fn(item)
                else:
                    with ThreadPoolExecutor(threads) as pool:
                        list(pool.map(fn, items))

            row["map_s"] = clock(lambda: run(lambda p: backend.map(p[0], size, p[1]), pairs))
            row["unmap_s"] = clock(lambda: run(lambda p: backend.unmap(p[0], size), pairs))
            row["release_s"] = clock(lambda: run(lambda p: backend.release(p[1]), pairs))
        rec.emit(case="vmm", total=total, count=count, threads=threads, **row)
        for va in vas:
            backend.free_reservation(va, size)


def probe_arena(rec: Recorder, backend: CudaBackend) -> None:
    """Populating and pinning 8 GiB of host memory, in chunks, with various thread counts."""
    total = 8 * GiB
    for chunk, threads, huge in [
        (GiB, 1, True),
        (GiB, 8, True),
        (GiB, 16, True),
        (GiB, 8, False),
        (256 * MiB, 16, True),
    ]:
        count = total // chunk
        addresses = [libc.map_anonymous(chunk) for _ in range(count)]

        def populate(address: int) -> None:
            if huge:
                libc.populate(address, chunk)
            else:
                libc._libc.madvise(address, chunk, libc.MADV_POPULATE_WRITE)

        with ThreadPoolExecutor(threads) as pool:
            populate_s = clock(lambda: list(pool.map(populate, addresses)))
            pin_s = clock(lambda: list(pool.map(lambda a: backend.pin(a, chunk), addresses)))
        both = [libc.map_anonymous(chunk) for _ in range(count)]
        with ThreadPoolExecutor(threads) as pool:
            fused_s = clock(
                lambda: list(pool.map(lambda a: (populate(a), backend.pin(a, chunk)), both))
            )
        rec.emit(
            case="arena",
            chunk=chunk,
            threads=threads,
            thp=huge,
            populate_s=populate_s,
            pin_s=pin_s,
            populate_and_pin_s=fused_s,
            s_per_gib=fused_s / (total / GiB),
        )
        for address in addresses + both:
            backend.unpin(address, chunk)
            libc.munmap(address, chunk)


@triton.jit
def _variant_kernel(
    src, out, num_words, MODE: tl.constexpr, BLOCK: tl.constexpr, TILES: tl.constexpr
):
    pid = tl.program_id(0)
    a0 = tl.zeros([BLOCK], dtype=tl.uint32)
    a1 = tl.zeros([BLOCK], dtype=tl.uint32)
    a2 = tl.zeros([BLOCK], dtype=tl.uint32)
    a3 = tl.zeros([BLOCK], dtype=tl.uint32)
    base = pid.to(tl.int64) * BLOCK * TILES
    for t in range(TILES):
        pos = base + t * BLOCK + tl.arange(0, BLOCK)
        mask = pos < num_words
        w = tl.load(src + pos, mask=mask, other=0).to(tl.uint32, bitcast=True)
        p = pos.to(tl.uint32)
        if MODE == 0:  # 4 x fmix32 lanes
            x = w ^ (p * 0x9E3779B1)
            a0 += tl.where(mask, _fmix32(x ^ 0x5BD1E995), 0)
            a1 += tl.where(mask, _fmix32(x ^ 0xCC9E2D51), 0)
            a2 += tl.where(mask, _fmix32(x ^ 0x1B873593), 0)
            a3 += tl.where(mask, _fmix32(x ^ 0x7F4A7C15), 0)
        elif MODE == 1:  # 4 multilinear lanes, odd position keys
            a0 += w * ((p * 0x9E3779B1 + 0x7F4A7C15) | 1)
            a1 += w * ((p * 0x85EBCA77 + 0x165667B1) | 1)
            a2 += w * ((p * 0xC2B2AE3D + 0x27D4EB2F) | 1)
            a3 += w * ((p * 0x61C88647 + 0x2545F491) | 1)
        else:  # 1 fmix lane + 3 multilinear lanes over w and the mixed word
            h = _fmix32(w ^ (p * 0x9E3779B1))
            a0 += tl.where(mask, h, 0)
            a1 += h * ((p * 0x85EBCA77 + 0x165667B1) | 1)
            a2 += w * ((p * 0xC2B2AE3D + 0x27D4EB2F) | 1)
            a3 += (h ^ w) * ((p * 0x61C88647 + 0x2545F491) | 1)
    tl.store(out + pid * 4 + 0, tl.sum(a0).to(tl.int32, bitcast=True))
    tl.store(out + pid * 4 + 1, tl.sum(a1).to(tl.int32, bitcast=True))
    tl.store(out + pid * 4 + 2, tl.sum(a2).to(tl.int32, bitcast=True))
    tl.store(out + pid * 4 + 3, tl.sum(a3).to(tl.int32, bitcast=True))


def probe_hash(rec: Recorder) -> None:
    from dormant.memory.backend import Span
    from dormant.memory.cuda_hash import hash_spans

    nbytes = 8 * GiB
    data = torch.randint(-(2**31), 2**31 - 1, (nbytes // 4,), dtype=torch.int32, device="cuda")
    span = [Span(data.data_ptr(), nbytes)]
    hash_spans(span, data.device)
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        times.append(clock(lambda: hash_spans(span, data.device)))
    rec.emit(
        case="hash",
        variant="shipped",
        nbytes=nbytes,
        median_s=statistics.median(times),
        gbps=nbytes / statistics.median(times) / 1e9,
    )
    for block, tiles in [(1024, 16), (2048, 8)]:
        out = torch.empty(
            (triton.cdiv(nbytes // 4, block * tiles), 4), dtype=torch.int32, device="cuda"
        )
        for mode in (0, 1, 2):
            launch = lambda: _variant_kernel[(out.shape[0],)](  # noqa: E731
                data, out, nbytes // 4, MODE=mode, BLOCK=block, TILES=tiles
            )
            ms = triton.testing.do_bench(launch, warmup=50, rep=300, return_mode="median")
            rec.emit(
                case="hash",
                variant=f"mode{mode}",
                block=block,
                tiles=tiles,
                nbytes=nbytes,
                median_s=ms / 1e3,
                gbps=nbytes / (ms / 1e3) / 1e9,
            )


def probe_hash_stages(rec: Recorder, num_spans: int = 195) -> None:
    """The shipped hash path over 8 GiB in ``num_spans`` spans (an 8B model's weight segments),
    stage by stage, with the device idle between stages."""
    from dormant.memory.backend import Span
    from dormant.memory.cuda_hash import hash_spans, launch, span_sums, span_table

    size = 8 * GiB // num_spans // 16 * 16
    data = torch.randint(-(2**31), 2**31 - 1, (size * num_spans // 4,), dtype=torch.int32,
                         device="cuda")  # fmt: skip
    spans = [Span(data.data_ptr() + i * size, size) for i in range(num_spans)]
    rows, num_programs = span_table(spans, data.data_ptr())
    table = torch.from_numpy(rows).cuda()
    partials = launch(data, table, num_programs)
    stages = {
        "span_table": lambda: span_table(spans, data.data_ptr()),
        "upload": lambda: torch.from_numpy(rows).cuda(),
        "kernel": lambda: launch(data, table, num_programs),
        "span_sums": lambda: span_sums(partials, table).cpu(),
        "whole": lambda: hash_spans(spans, data.device),
        "whole, base given": lambda: hash_spans(spans, data.device, base=data),
    }
    for stage, fn in stages.items():
        times = []
        for _ in range(12):
            torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        rec.emit(case="hash stages", stage=stage, num_spans=num_spans, nbytes=size * num_spans,
                 median_s=statistics.median(times[2:]), min_s=min(times[2:]))  # fmt: skip


def probe_hash_in_manager(rec: Recorder) -> None:
    """The same stages over the allocations a MemoryManager made for the 8B-like weight set
    (each at its own reserved address range), as a level-1 sleep hashes them."""
    from benchmarks.sleep_wake import weight_mix
    from dormant.memory import MemoryManager
    from dormant.memory.cuda_hash import _nothing, hash_spans, launch, span_sums, span_table
    from dormant.memory.dlpack import tensor_at

    mm = MemoryManager("cuda")
    tensors = [mm.empty((n,), torch.bfloat16, "weights") for n in weight_mix()]
    for tensor in tensors:
        tensor.view(torch.int16).random_()
    spans = [a.span for a in mm._table.allocations(["weights"])]
    base_address = min(s.address for s in spans)
    base = tensor_at(base_address, 16, torch.device("cuda"), _nothing).view(torch.int32)
    rows, num_programs = span_table(spans, base_address)
    table = torch.from_numpy(rows).cuda()
    partials = launch(base, table, num_programs)

    def after_a_cycle() -> None:  # a sleep that copies nothing, then a wake: fresh mappings
        mm.sleep(tags={"weights": "discard"})
        mm.wake_up()

    stages = {
        "span_table": lambda: span_table(spans, base_address),
        "kernel": lambda: launch(base, table, num_programs),
        "span_sums": lambda: span_sums(partials, table).cpu(),
        "whole": lambda: hash_spans(spans, torch.device("cuda")),
        "hash_batch": lambda: _hash_batch(mm.backend, spans),
        "whole, after 0.25 s idle": lambda: hash_spans(spans, torch.device("cuda")),
        "kernel, after 0.25 s idle": lambda: launch(base, table, num_programs),
        "kernel, on fresh mappings": lambda: launch(base, table, num_programs),
    }
    for stage, fn in stages.items():
        times = []
        for _ in range(12):
            torch.cuda.synchronize()
            if "idle" in stage:  # as between a wake and the next sleep, when the GPU clocks down
                time.sleep(0.25)
            if "fresh" in stage:
                after_a_cycle()
                torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        rec.emit(case="hash in manager", stage=stage, num_spans=len(spans),
                 span_extent=max(s.address + s.nbytes for s in spans) - base_address,
                 median_s=statistics.median(times[2:]), min_s=min(times[2:]))  # fmt: skip
    tensors.clear()
    mm.close()


def _hash_batch(backend, spans) -> list[bytes]:
    """The backend's own path: one group, waited for."""
    hashes = backend.hash_batch()
    return hashes.wait(hashes.add(spans))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--only-hash", action="store_true", help="skip the VMM and arena probes")
    args = parser.parse_args()
    rec = Recorder(args.out)
    rec.emit(case="environment", **environment())
    backend = CudaBackend(torch.cuda.current_device())
    probe_hash(rec)
    probe_hash_stages(rec)
    probe_hash_in_manager(rec)
    if not args.only_hash:
        probe_vmm(rec, backend)
        probe_arena(rec, backend)


if __name__ == "__main__":
    main()
