"""GRPO-shaped rollout throughput on one GPU: prefix caching off/on x chunked prefill off/on,
decode steps against the HBM roofline, and full RL cycles.

Workload (the default): a Qwen3-8B-shaped model with random bf16 weights; 64 prompts of 512
random tokens, ``n=8``, 512 output tokens each, ``temperature=1.0``, ``logprobs=0``,
``ignore_eos`` (512 sequences, 262,144 generated tokens per generate). ``--quick`` runs 16
prompts of 256 tokens with 128 output tokens.

Reported per variant (one JSON line each, then a table):
- generated tokens/s over the whole ``generate``;
- prefill tokens computed and prefill tokens/s (over the steps that computed any prompt
  position; a mixed step counts whole), and the cut in prefill work against caching off;
- prefix-cache hit rate (tokens found cached / tokens looked up);
- decode-only steps against the roofline at the batch sizes reached: (weight bytes + the KV
  bytes the step reads) / the measured device-copy bandwidth (bytes read + written per second
  of a large device-to-device copy), by batch-size bucket; and against that roofline with
  compute added (``x_compute_bound``: the GEMMs at the longer of their weight read and their
  flops at the measured bf16 GEMM rate), which a large batch's compute-bound GEMMs set.

The four variants run on one engine (same weights, same graphs, same KV cache): only the
scheduler and block manager are rebuilt with the variant's options between them.

Then ``--cycles`` RL iterations with both features on: generate -> sleep(2) -> a stand-in
trainer step (it takes most of the freed memory and multiplies matrices in it) ->
wake_up(["weights"]) -> update_weights (new random weights, from the "trainer") ->
wake_up(["kv_cache"]) -> generate the same prompts again. Throughput after a cycle should equal
throughput before it (the generate's tokens/s, and a decode step's median device time, which
leaves the host out), and the hit rate must drop to the prompts' own n-sharing: the engine
invalidated the cache itself (no reset_prefix_cache call anywhere in this file).

Each variant runs with async scheduling off, then on (``--async-scheduling on,off`` reverses
the order; ``on`` runs it on alone): the engine queues the next decode call before reading the
one in flight. A call's time is the device's (``StepLog``), so the host work async scheduling
hides shows in the generated tokens/s, not in the step times.

``--multi-steps k`` captures the fused k-step decode graph (``cuda_graph_multi_steps``); a replay
then counts as k decode steps of its mean time, against the mean of their rooflines.

Usage: python benchmarks/rollout.py [--quick] [--cycles 1] [--multi-steps 1]
       [--async-scheduling off,on] [--max-num-seqs 512] [--out rollout.jsonl]
(``--smoke`` runs a tiny model on whatever device there is, to check the script: no numbers.)
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import Recorder, environment, table
from benchmarks.decode import QWEN3_8B_LIKE, device_copy_bandwidth, matmul_flops_per_s
from dormant import LLM, SamplingParams
from dormant.engine.block_manager import BlockManager
from dormant.engine.scheduler import Scheduler
from dormant.models import ModelConfig

SMOKE_MODEL = {
    **QWEN3_8B_LIKE, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "eos_token_id": 511,
}  # fmt: skip
BUCKETS = (1, 8, 32, 64, 128, 256, 512)  # decode steps are grouped by the bucket they reach


class Step(NamedTuple):
    is_prefill: bool  # some row computed prompt positions (run eagerly, not from a graph)
    num_seqs: int
    num_prefill_tokens: int
    kv_tokens: int  # positions whose KV the (first) step's attention reads
    seconds: float
    num_steps: int = 1  # decode steps in this call (the fused multi-step graph runs several)


class StepLog:
    """Times every worker call of the engine, with what the scheduler put in it.

    A call's time runs from when the device could start it to when its last kernel ended: on
    CUDA, events recorded on the stream at its launch and after it. A call queued behind
    another (async scheduling) starts when that one ends, so the host work it overlapped is
    not in it; a call launched after the one before was read starts at its launch, so the
    worker's host work on it is (what the GPU waits on). On the CPU: launch to result."""

    def __init__(self, llm: LLM) -> None:
        self.engine = llm.llm_engine
        self.batches: list[Any] = []
        self.steps: list[Step] = []
        self._events: list[tuple[Any, Any]] = []  # (start, end) per call, CUDA only
        executor = self.engine.executor
        launch = executor.launch  # every call of an in-process rank
        on_cuda = executor.worker.device.type == "cuda"

        def timed(step, multi_step=False):  # type: ignore[no-untyped-def]
            start = time.perf_counter()
            if on_cuda:
                events = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                events[0].record()
            pending = launch(step, multi_step)
            if on_cuda:
                events[1].record()
                self._events.append(events)
            else:
                pending.result()
            batch = self.batches[-1]  # the engine launches each batch as it is planned
            kv_tokens = sum(s.start_position + len(s.token_ids) for s in step.seqs)
            seconds = time.perf_counter() - start  # the CPU's; CUDA's come from the events
            self.steps.append(Step(batch.is_prefill, batch.num_seqs, batch.num_prefill_tokens,
                                   kv_tokens, seconds, batch.num_steps))  # fmt: skip
            return pending

        executor.launch = timed  # type: ignore[method-assign]
        self.attach(self.engine.scheduler)

    def finish(self) -> None:
        """Sets each call's time from its CUDA events (after the generate returned)."""
        if not self._events:
            return
        self._events[-1][1].synchronize()
        self.steps = [
            step._replace(seconds=start.elapsed_time(end) / 1e3)
            for step, (start, end) in zip(self.steps, self._events, strict=True)
        ]
        self._events.clear()

    def attach(self, scheduler: Scheduler) -> None:
        """Records every batch ``scheduler`` hands out (call again for a new scheduler)."""
        schedule = scheduler.schedule

        schedule_successor = scheduler.schedule_successor

        def recorded():  # type: ignore[no-untyped-def]
            batch = schedule()
            if batch is not None:
                self.batches.append(batch)
            return batch

        def recorded_successor(before):  # type: ignore[no-untyped-def]
            batch = schedule_successor(before)
            if batch is not None:
                self.batches.append(batch)
            return batch

        scheduler.schedule = recorded  # type: ignore[method-assign]
        scheduler.schedule_successor = recorded_successor  # type: ignore[method-assign]

    def clear(self) -> None:
        self.batches.clear()
        self.steps.clear()
        self._events.clear()


def variant(
    llm: LLM, log: StepLog, prefix_caching: bool, chunked: bool, overlap: bool = True
) -> None:
    """Rebuilds the engine's scheduler and block manager (empty, so the prefix cache is cold)
    with these options, and sets its async scheduling; the model, its graphs and the KV cache
    stay."""
    engine = llm.llm_engine
    engine.async_scheduling = overlap
    old = engine.scheduler
    assert not old.has_unfinished
    config = replace(old.config, enable_chunked_prefill=chunked)
    manager = old.block_manager
    blocks = BlockManager(manager.num_blocks, manager.block_size, prefix_caching)
    engine.scheduler = Scheduler(config, blocks, old.eos_token_ids)
    log.attach(engine.scheduler)


def prompts(num_prompts: int, prompt_len: int, vocab: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, vocab - 10, (num_prompts, prompt_len), generator=generator)
    return ids.tolist()


def generate(llm: LLM, batch: list[list[int]], params: SamplingParams, log: StepLog) -> dict:
    """One generate, measured: throughput, prefill work, hit rate, decode steps vs roofline."""
    log.clear()
    before = llm.memory_status()[0].prefix_cache
    sync(llm.llm_engine.executor.worker.device)
    start = time.perf_counter()
    outputs = llm.generate(batch, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    log.finish()
    after = llm.memory_status()[0].prefix_cache
    generated = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    prefill = [s for s in log.steps if s.is_prefill]
    prefill_tokens = sum(s.num_prefill_tokens for s in prefill)
    prefill_s = sum(s.seconds for s in prefill)
    queries = after.num_query_tokens - before.num_query_tokens
    hits = after.num_hit_tokens - before.num_hit_tokens
    return {
        "seconds": seconds,
        "generated_tokens": generated,
        "generated_tokens_per_s": generated / seconds,
        "prefill_tokens": prefill_tokens,
        "prefill_step_s": prefill_s,
        "prefill_tokens_per_s": prefill_tokens / prefill_s if prefill_s else 0.0,
        "num_steps": len(log.steps),
        "num_mixed_or_prefill_steps": len(prefill),
        "hit_rate": hits / queries if queries else 0.0,
        "num_cached_tokens_first": outputs[0].num_cached_tokens,
        "decode": [s for s in log.steps if not s.is_prefill],
    }


def decode_step_s(decode: list[Step]) -> float:
    """The median time of a decode step (a multi-step call counts as its steps' mean)."""
    return statistics.median(s.seconds / s.num_steps for s in decode)


class Device(NamedTuple):
    bandwidth: float  # bytes read plus written per second, a device-to-device copy
    flops: float  # bf16 GEMM flop/s, a large matmul


def roofline_rows(
    decode: list[Step], weight_bytes: int, gemm_params: int, kv_per_token: int, device: Device
) -> Iterator[dict[str, Any]]:
    """Decode-only steps by batch-size bucket: median step time against its roofline. A call
    that ran ``k`` steps (the fused multi-step graph) counts as ``k`` steps of its mean time,
    against the mean of their rooflines (step ``j`` reads ``j`` more positions per row).

    Also against a bound that adds compute to the roofline: the GEMMs take the longer of
    reading their weights and their ``2 * gemm_params * batch`` flops at the measured GEMM
    rate, and attention reads the KV at the copy bandwidth. At large batches the GEMMs are
    compute-bound (batch 512 of an 8B model: 7.8 TFLOP, about 9 ms on an H200, against 3.9 ms
    to read the weights), so the memory roofline alone is out of reach there."""
    by_bucket: dict[int, list[Step]] = defaultdict(list)
    for step in decode:
        bucket = next((b for b in BUCKETS if step.num_seqs <= b), BUCKETS[-1])
        by_bucket[bucket].append(step)
    for bucket, steps in sorted(by_bucket.items()):
        times = [s.seconds / s.num_steps for s in steps]
        kv_s = [
            (s.kv_tokens + s.num_seqs * (s.num_steps - 1) / 2) * kv_per_token / device.bandwidth
            for s in steps
        ]
        limits = [weight_bytes / device.bandwidth + kv for kv in kv_s]
        gemm_s = [
            max(weight_bytes / device.bandwidth, 2 * gemm_params * s.num_seqs / device.flops)
            for s in steps
        ]
        bounds = [g + kv for g, kv in zip(gemm_s, kv_s, strict=True)]
        ratios = sorted(t / lim for t, lim in zip(times, limits, strict=True))
        bound_ratios = sorted(t / b for t, b in zip(times, bounds, strict=True))
        yield {
            "batch_bucket": bucket,
            "num_steps": len(steps),
            "median_batch": statistics.median(s.num_seqs for s in steps),
            "step_s": statistics.median(times),
            "roofline_s": statistics.median(limits),
            "x_roofline": statistics.median(ratios),
            "x_roofline_p90": ratios[int(0.9 * (len(ratios) - 1))],
            "compute_bound_s": statistics.median(bounds),
            "x_compute_bound": statistics.median(bound_ratios),
        }


def num_gemm_params(model: torch.nn.Module) -> int:
    """Weights every token multiplies: the matrices, less the input embedding (a lookup) unless
    it is also the LM head (tied embeddings: no ``lm_head`` matrix of its own)."""
    matrices = {name: p.numel() for name, p in model.named_parameters() if p.dim() == 2}
    has_head = any("lm_head" in name for name in matrices)
    return sum(n for name, n in matrices.items() if not (has_head and "embed_tokens" in name))


def own_sharing_hit_rate(n: int) -> float:
    """The hit rate of a prompt seen for the first time: its first sample computes it, the
    other ``n - 1`` fork from it (``engine/forks.py``: each counts the whole prompt as hit).
    A sibling that could not fork hits less: the full blocks before its last prompt token."""
    return (n - 1) / n


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def trainer_step(device: torch.device, fraction: float = 0.6) -> dict[str, Any]:
    """The trainer's turn: takes ``fraction`` of the free memory and multiplies in it."""
    on_gpu = device.type == "cuda"
    free = torch.cuda.mem_get_info(device)[0] if on_gpu else 256 << 20
    start = time.perf_counter()
    held = torch.empty(int(free * fraction), dtype=torch.uint8, device=device)
    held.fill_(1)
    size = 8192 if on_gpu else 256
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    for _ in range(20):
        a = torch.tanh(a @ a)
    sync(device)
    taken = held.numel()
    del held, a
    if on_gpu:
        torch.cuda.empty_cache()
    seconds = time.perf_counter() - start
    return {"free_before_trainer": free, "trainer_took": taken, "trainer_s": seconds}


def new_weights(llm: LLM, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    """What the trainer sends: every checkpoint tensor, fresh, on the GPU, one at a time."""
    worker = llm.llm_engine.executor.worker
    device = worker.device
    generator = torch.Generator(device=device).manual_seed(seed)
    for name, shape in worker.model.expected_weight_shapes().items():
        if "norm" in name:
            yield name, torch.ones(shape, dtype=torch.bfloat16, device=device)
        else:
            values = torch.randn(shape, generator=generator, device=device, dtype=torch.bfloat16)
            yield name, values.mul_(0.02)


def on_off_list(value: str) -> list[bool]:
    """``"off,on"`` -> [False, True] (argparse's type for ``--async-scheduling``)."""
    words = value.split(",")
    if not words or any(word not in ("on", "off") for word in words):
        raise argparse.ArgumentTypeError(f"expected on/off words joined by commas, got {value!r}")
    return [word == "on" for word in words]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="16 prompts x 256, 128 out")
    parser.add_argument("--cycles", type=int, default=1, help="RL iterations (default 1)")
    parser.add_argument("--smoke", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--multi-steps", type=int, default=1,
        help="cuda_graph_multi_steps: decode steps per fused graph replay (default 1: none)",
    )  # fmt: skip
    parser.add_argument(
        "--async-scheduling", default=[False, True], type=on_off_list,
        help="each variant with async scheduling in this order (default off,on: side by side)",
    )  # fmt: skip
    parser.add_argument(
        "--max-num-seqs", type=int, default=None,
        help="the engine's max_num_seqs (default: every sequence at once, 512)",
    )  # fmt: skip
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    num_prompts, prompt_len, out_len = (16, 256, 128) if args.quick else (64, 512, 512)
    shape, options = QWEN3_8B_LIKE, {"gpu_memory_utilization": 0.9}
    if args.smoke:
        num_prompts, prompt_len, out_len = 3, 24, 6
        shape, options = SMOKE_MODEL, {"kv_cache_memory_bytes": 64 << 20}
    n = 8
    started = time.perf_counter()
    rec = Recorder(args.out)
    on_gpu = torch.cuda.is_available()
    rec.emit(case="environment", quick=args.quick, **(environment() if on_gpu else {}))
    device = (  # smoke runs: stand-ins
        Device(device_copy_bandwidth(), matmul_flops_per_s()) if on_gpu else Device(1e10, 1e11)
    )
    start = time.perf_counter()
    max_seqs = args.max_num_seqs or num_prompts * n
    llm = LLM(
        ModelConfig.from_dict(shape), max_model_len=prompt_len + out_len, max_num_seqs=max_seqs,
        max_num_batched_tokens=8192, cuda_graph_multi_steps=args.multi_steps,
        enable_sleep_mode=True,
        **options,
    )  # fmt: skip
    worker = llm.llm_engine.executor.worker
    model_config = llm.llm_engine.config.model_config
    weight_bytes = sum(p.numel() * p.element_size() for p in worker.model.parameters())
    gemm_params = num_gemm_params(worker.model)
    kv_per_token = (
        2 * model_config.num_hidden_layers * model_config.num_key_value_heads
        * model_config.head_dim * llm.llm_engine.config.cache_dtype.itemsize
    )  # fmt: skip
    rec.emit(
        case="setup", load_and_capture_s=time.perf_counter() - start, weight_bytes=weight_bytes,
        kv_bytes_per_token=kv_per_token, d2d_bytes_per_s=device.bandwidth,
        gemm_flops_per_s=device.flops, gemm_params=gemm_params,
        num_kv_blocks=llm.llm_engine.runtime.num_kv_blocks, max_num_seqs=max_seqs,
    )  # fmt: skip
    log = StepLog(llm)
    params = SamplingParams(
        n=n, temperature=1.0, max_tokens=out_len, logprobs=0, ignore_eos=True, seed=0
    )
    vocab = model_config.vocab_size
    warm = SamplingParams(n=2, temperature=1.0, max_tokens=8, ignore_eos=True)
    llm.generate(prompts(4, prompt_len, vocab, seed=99), warm, use_tqdm=False)

    rows, summary = [], {}
    batch = prompts(num_prompts, prompt_len, vocab, seed=0)
    overlaps = args.async_scheduling
    for caching, chunked, overlap in itertools.product((False, True), (False, True), overlaps):
        variant(llm, log, caching, chunked, overlap)
        result = generate(llm, batch, params, log)
        name = f"caching {'on' if caching else 'off'}, chunked {'on' if chunked else 'off'}"
        name += f", async {'on' if overlap else 'off'}"
        summary[(caching, chunked)] = result
        decode = list(
            roofline_rows(result.pop("decode"), weight_bytes, gemm_params, kv_per_token, device)
        )
        large = [row["x_roofline"] for row in decode if row["batch_bucket"] >= 64]
        rows.append(rec.emit(
            case="rollout", variant=name, **result, ended_at=time.time(),  # the epoch's seconds
            x_roofline_b64_plus=max(large) if large else None,  # the worst bucket >= 64
        ))  # fmt: skip
        for row in decode:
            rec.emit(case="decode_vs_roofline", variant=name, **row)
    for chunked in (False, True):
        off, on = summary[(False, chunked)], summary[(True, chunked)]
        cut = 1 - on["prefill_tokens"] / off["prefill_tokens"]
        rows.append(rec.emit(case="prefill_cut", chunked=chunked, cut=cut, target=1 - 1 / n))

    variant(llm, log, True, True)  # the engine's defaults
    for cycle in range(args.cycles):  # fresh prompts each iteration, as an RL loop has
        batch = prompts(num_prompts, prompt_len, vocab, seed=1 + cycle)
        before = generate(llm, batch, params, log)
        t0 = time.perf_counter()
        llm.sleep(level=2)
        sleep_s = time.perf_counter() - t0
        trainer = trainer_step(worker.device)
        t0 = time.perf_counter()
        llm.wake_up(["weights"])
        llm.update_weights(new_weights(llm, seed=1000 + cycle))
        assert llm.wake_up(["kv_cache"])
        refit_s = time.perf_counter() - t0
        # The same prompts again: every block of theirs was cached, and must not be hit now.
        after = generate(llm, batch, params, log)
        rows.append(rec.emit(
            case="rl_cycle", cycle=cycle, sleep_s=sleep_s, wake_and_refit_s=refit_s, **trainer,
            tokens_per_s_before=before["generated_tokens_per_s"],
            tokens_per_s_after=after["generated_tokens_per_s"],
            x_after_over_before=after["generated_tokens_per_s"] / before["generated_tokens_per_s"],
            # The device's view, without the host: a decode step's median time (per step).
            decode_step_s_before=decode_step_s(before["decode"]),
            decode_step_s_after=decode_step_s(after["decode"]),
            x_decode_step_after_over_before=decode_step_s(after["decode"])
            / decode_step_s(before["decode"]),
            hit_rate_before=before["hit_rate"], hit_rate_after=after["hit_rate"],
            own_sharing_hit_rate=own_sharing_hit_rate(n),
        ))  # fmt: skip
    print(llm.memory_status()[0].table())
    llm.shutdown()
    rec.emit(case="total", seconds=time.perf_counter() - started)
    columns = [
        "case", "variant", "generated_tokens_per_s", "prefill_tokens", "prefill_tokens_per_s",
        "hit_rate", "x_roofline_b64_plus", "cut", "cycle", "x_after_over_before",
        "x_decode_step_after_over_before", "hit_rate_before", "hit_rate_after",
    ]  # fmt: skip
    print(table(rows, columns))


if __name__ == "__main__":
    main()
