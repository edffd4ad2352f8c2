"""Host (CPU) time of one decode step, without the forward: what the GPU waits on between steps.

Two levels, at each batch size (1, 64, 128 by default), on a 1-layer tiny Qwen3 (fp32):

- **worker**: ``worker.execute(step)`` of a decode step, advanced after each step as the engine
  sends them (each request's params shared by its 8 samples, a block-table tuple covering its
  positions, made again when it grows): input buffers, the sampler's per-step tensors,
  sampling, the host copy and the step output;
- **engine**: ``LLMEngine.step()`` with that many running requests (``temperature=1.0``,
  ``logprobs=0``, ``ignore_eos``, detokenized by the byte tokenizer): schedule, step input,
  execute, postprocess, logprobs and outputs.

By default the forward is a stub (the token embedding only, see ``ForwardTimer``);
``--forward model`` runs the real 1-layer model. Either way the forward (``model.forward`` and
``model.compute_logits``) is timed around and subtracted from each step's time, so what is
left is host work. On the CPU the sampler's tensor ops run inline too; the vocabulary is 264,
just past the byte tokenizer's 258 ids, so they stay small.

Times are the thread's CPU time (``time.thread_time``), not wall time: the host path is one
thread, and CPU time leaves out the moments another process held the core, so figures from a
busy machine still compare. Prints one JSON line per measurement (median, min, max over the
timed steps) and a table.

``--multi-steps k`` times the decode-graph path instead: the runner gets ``DecodeGraphs`` of
one batch size (the batch's), "captured" with the CPU stand-ins (``worker/eager_graphs.py``)
whose replay runs the graph's body eagerly. At the worker level each call is
``execute_multi_step(step)`` (k > 1: the fused k-step graph, what ``benchmarks/rollout.py
--multi-steps k`` times on the H200) or ``execute(step)`` (k = 1: the full graph, then the
sampler), its step advanced k tokens. At the engine level the worker reports the graphs'
batch to the engine as a GPU worker does, so each ``LLMEngine.step()`` is one such call and
the engine's work around it (schedule, step input, ``postprocess_steps`` and the outputs of k
tokens per row). The whole replay is timed and subtracted (on a GPU it is one launch), so
what is left is host work; ``median_us`` is per call, ``per_step_us`` per decode step.

Usage: python benchmarks/host_overhead.py [--batch-sizes 1 64 128] [--context 1024]
       [--steps 40] [--level worker|engine|both] [--multi-steps k] [--profile]
       [--gc-freeze] [--out results.jsonl]
(``--profile`` prints cProfile's top functions of the largest batch at each level.) Each line
also counts the garbage collector's automatic collections per generation in the timed calls
(their time is in the figures: the oldest generation's make the mean exceed the median);
``--gc-freeze`` freezes the set-up's objects first, so those collections skip them.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import gc
import os
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import Recorder, table
from dormant import LLM, SamplingParams
from dormant.core.step_input import SeqInput, StepInput
from dormant.core.step_output import StepOutput
from dormant.models import ModelConfig
from dormant.worker.cuda_graphs import DecodeGraphs
from dormant.worker.eager_graphs import capture_eagerly, num_replays
from dormant.worker.model_runner import ModelRunner
from dormant.worker.worker import Worker

TINY_QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"], "vocab_size": 264, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6, "rope_theta": 1e6, "tie_word_embeddings": False,
    "torch_dtype": "float32", "eos_token_id": 2,
}  # fmt: skip
WARMUP_STEPS = 3
SAMPLES_PER_REQUEST = 8  # the GRPO rollout's n (benchmarks/rollout.py): rows share their params


class ForwardTimer:
    """Wraps a model's ``forward`` and ``compute_logits`` on the instance and sums their time.
    (On the CPU both run inline, so the time around them is their cost.)

    With ``stub`` the forward is only the token embedding (no attention, no KV write): the
    host work around it is the same, and the big forward's cache and allocator churn no longer
    leaks into the host figures (the tokens differ from the real model's; nothing checks them).

    With ``graphs`` the model's methods are left untimed (and ``compute_logits`` unpatched:
    the runner runs eagerly once it is patched) and the time of each ``replay`` of the runner's
    graphs is summed instead (``time_replays``).
    """

    def __init__(self, model: torch.nn.Module, stub: bool, graphs: bool = False) -> None:
        self.seconds = 0.0
        embed, forward = model.model.embed_tokens, model.forward

        def stub_forward(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            return embed(input_ids)

        if graphs:
            if stub:
                model.forward = stub_forward
            return
        model.forward = self._timed(stub_forward if stub else forward)
        model.compute_logits = self._timed(model.compute_logits)

    def time_replays(self, graphs: DecodeGraphs) -> None:
        for captured in (*graphs.full.values(), *graphs.multi_step.values()):
            graph = captured.graph
            graph.replay = self._timed(graph.replay)  # type: ignore[method-assign]

    def _timed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.thread_time() - start

        return timed


def host_times(
    run: Callable[[], Any],
    timer: ForwardTimer,
    num_steps: int,
    after: Callable[[Any], None] = lambda _: None,
) -> list[float]:
    """Per step: the thread's CPU time of ``run()`` minus the forward's, in seconds.
    ``after`` gets each result, untimed (the benchmark's own bookkeeping)."""
    times = []
    for _ in range(num_steps):
        before = timer.seconds
        start = time.thread_time()
        result = run()
        step_seconds = time.thread_time() - start
        times.append(step_seconds - (timer.seconds - before))
        after(result)
    return times


def make_llm(
    batch_size: int, context: int, num_steps: int, multi_steps: int = 1, graphs: bool = False
) -> LLM:
    """The tiny engine, eager; with ``graphs`` its worker gets decode graphs of the batch size
    (CPU stand-ins, ``install_graphs``) when its KV cache is made and reports their multi-step
    batch, so the scheduler plans ``multi_steps``-step decode batches as on a GPU."""
    num_positions = context + (num_steps + WARMUP_STEPS + 1) * multi_steps
    max_model_len = 1 << (num_positions + batch_size + 64).bit_length()
    options = dict(
        max_model_len=max_model_len,
        max_num_seqs=max(batch_size, 1),
        max_num_batched_tokens=max(max_model_len, 4096),
        kv_cache_memory_bytes=max(batch_size, 8) * max_model_len * 2 * 2 * 16 * 4 + (8 << 20),
        enforce_eager=True,
        cuda_graph_multi_steps=multi_steps,
    )
    if not graphs:
        return LLM(ModelConfig.from_dict(TINY_QWEN3), **options)
    init_kv_cache = Worker.init_kv_cache

    def init_with_graphs(worker: Worker, num_blocks: int) -> int:
        init_kv_cache(worker, num_blocks)
        install_graphs(worker.runner, batch_size, multi_steps)
        return batch_size if multi_steps > 1 else 0

    Worker.init_kv_cache = init_with_graphs  # type: ignore[method-assign]
    try:
        return LLM(ModelConfig.from_dict(TINY_QWEN3), **options)
    finally:
        Worker.init_kv_cache = init_kv_cache  # type: ignore[method-assign]


def worker_case(
    batch_size: int,
    context: int,
    num_steps: int,
    stub: bool,
    profile: bool,
    multi_steps: int | None = None,
    gc_freeze: bool = False,
) -> Timed:
    """Decode steps as the engine sends them: each request's params (the engine clones them
    per request; its ``n`` samples share them: ``SAMPLES_PER_REQUEST``), a block-table tuple
    covering its positions (made again only when the table grew, as the engine's
    ``Sequence.block_table_tuple``), one token.

    ``multi_steps`` k: through the decode graphs (CPU stand-ins, their replays subtracted),
    each call ``k`` steps (``execute_multi_step`` for k > 1), its tables covering them."""
    k = multi_steps or 1
    llm = make_llm(batch_size, context, num_steps, k)
    worker = llm.llm_engine.executor.worker  # type: ignore[attr-defined]
    timer = ForwardTimer(worker.runner.model, stub, graphs=multi_steps is not None)
    if multi_steps is not None:
        timer.time_replays(install_graphs(worker.runner, batch_size, k))
    block_size = llm.llm_engine.config.block_size
    blocks_per_seq = -(-(context + (WARMUP_STEPS + num_steps + 1) * k) // block_size)
    params = SamplingParams(temperature=1.0, logprobs=0, ignore_eos=True)
    per_request = [params.clone() for _ in range(-(-batch_size // SAMPLES_PER_REQUEST))]
    blocks = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(batch_size)]
    seqs = [
        SeqInput((11,), context, (), per_request[i // SAMPLES_PER_REQUEST], 1000 + i, 1)
        for i in range(batch_size)
    ]

    def step_input() -> StepInput:
        rows = []
        for i, seq in enumerate(seqs):
            num_blocks = (seq.start_position + k - 1) // block_size + 1
            if len(seq.block_table) != num_blocks:  # a new tuple only when the table grew,
                seq = seqs[i] = dataclasses.replace(seq, block_table=tuple(blocks[i][:num_blocks]))
            rows.append(seq)  # as Sequence.block_table_tuple: the same ints, as the list's
        return StepInput(tuple(rows), is_prefill=False)

    state = {"step": step_input()}

    def advance(output: StepOutput) -> None:
        for i, (seq, row) in enumerate(zip(seqs, output.seqs, strict=True)):
            seqs[i] = dataclasses.replace(  # keeps the row's block-table tuple
                seq,
                token_ids=row.token_ids[-1:],
                start_position=seq.start_position + k,
                num_output_tokens=seq.num_output_tokens + k,
            )
        state["step"] = step_input()

    execute = worker.execute_multi_step if k > 1 else worker.execute

    def run() -> StepOutput:
        return execute(state["step"])

    for _ in range(WARMUP_STEPS):
        advance(run())
    timed = _maybe_profiled(profile, lambda: host_times(run, timer, num_steps, advance), gc_freeze)
    if multi_steps is not None:
        expected = WARMUP_STEPS + num_steps
        graphs = worker.runner.graphs.multi_step if k > 1 else worker.runner.graphs.full
        if num_replays(graphs) != expected:  # the graph path ran every call, none fell back
            raise RuntimeError(f"{num_replays(graphs)} graph replays for {expected} calls")
    llm.llm_engine.shutdown()
    return timed


def install_graphs(runner: ModelRunner, batch_size: int, multi_steps: int) -> DecodeGraphs:
    """Gives ``runner`` decode graphs of one batch size, ``batch_size``, captured eagerly (the
    CPU stand-ins), with ``multi_steps``-step graphs when it is above 1."""
    graphs = DecodeGraphs(
        runner.model, runner.inputs, runner.mm, [batch_size], multi_steps,
        runner.config.max_model_len, runner.logprobs_mode, runner.multi_step_top_logprobs,
    )  # fmt: skip
    with torch.inference_mode():
        capture_eagerly(graphs)
    runner.graphs = graphs
    return graphs


def engine_case(
    batch_size: int,
    context: int,
    num_steps: int,
    stub: bool,
    profile: bool,
    gc_freeze: bool,
    multi_steps: int | None = None,
) -> Timed:
    """``LLMEngine.step()`` of decode batches. ``multi_steps`` k: the worker's decode graphs
    (CPU stand-ins, their replays subtracted), each step a fused k-step call
    (``execute_multi_step``; k = 1: the full graph's ``execute``)."""
    k = multi_steps or 1
    llm = make_llm(batch_size, context, num_steps, k, graphs=multi_steps is not None)
    engine = llm.llm_engine
    runner = engine.executor.worker.runner  # type: ignore[attr-defined]
    timer = ForwardTimer(runner.model, stub, graphs=multi_steps is not None)
    if multi_steps is not None:
        timer.time_replays(runner.graphs)
    max_tokens = engine.config.max_model_len - context  # past the steps of every prefill
    for i in range(batch_size):
        prompt = [(7 * i + 13 * j) % 250 + 3 for j in range(context)]
        params = SamplingParams(
            temperature=1.0, logprobs=0, ignore_eos=True, max_tokens=max_tokens, seed=i
        )
        engine.add_request(prompt, params)
    while engine.scheduler.num_waiting:  # every prompt prefilled: the next steps are decodes
        engine.step()
    for _ in range(WARMUP_STEPS):
        engine.step()
    if engine.scheduler.num_running != batch_size:
        raise RuntimeError(f"{engine.scheduler.num_running} of {batch_size} requests running")
    captured = runner.graphs
    graphs = {} if captured is None else captured.multi_step if k > 1 else captured.full
    replays_before = num_replays(graphs)
    timed = _maybe_profiled(profile, lambda: host_times(engine.step, timer, num_steps), gc_freeze)
    replays = num_replays(graphs) - replays_before
    if multi_steps is not None and replays != num_steps:  # none fell back to eager steps
        raise RuntimeError(f"{replays} graph replays for {num_steps} steps")
    engine.shutdown()
    return timed


class Timed(NamedTuple):
    times: list[float]  # per call, as host_times
    gc_collections: list[int]  # automatic collections per generation during the timed calls


def _maybe_profiled(profile: bool, fn: Callable[[], list[float]], gc_freeze: bool = False) -> Timed:
    """Runs the timed calls ``fn``, counting the garbage collector's automatic collections
    (their time is in the calls' CPU time). ``gc_freeze``: first collect and freeze what the
    set-up left (``gc.freeze``, what vLLM does after its warm-up), so the oldest generation's
    collections no longer traverse the model and engine."""
    if gc_freeze:
        gc.collect()
        gc.freeze()
    before = [g["collections"] for g in gc.get_stats()]
    try:
        if not profile:
            times = fn()
        else:
            profiler = cProfile.Profile()
            times = profiler.runcall(fn)
            pstats.Stats(profiler).sort_stats(
                os.environ.get("PROFILE_SORT", "tottime")
            ).print_stats(30)
    finally:
        if gc_freeze:
            gc.unfreeze()
    collections = [g["collections"] - b for g, b in zip(gc.get_stats(), before, strict=True)]
    return Timed(times, collections)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64, 128])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--level", choices=("worker", "engine", "both"), default="both")
    parser.add_argument("--forward", choices=("stub", "model"), default="stub")
    parser.add_argument(
        "--multi-steps", type=int, default=None,
        help="time the decode-graph path, k steps per call (see the docstring)",
    )  # fmt: skip
    parser.add_argument("--profile", action="store_true")
    parser.add_argument(
        "--gc-freeze", action="store_true",
        help="gc.freeze() the set-up's objects before the timed steps (as vLLM after warm-up)",
    )  # fmt: skip
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.multi_steps is not None and (args.multi_steps < 1 or args.level == "both"):
        parser.error("--multi-steps k needs k >= 1 and --level worker or engine")
    torch.set_num_threads(1)  # the host path is single-threaded; keep the forward's noise low
    rec = Recorder(args.out)
    chosen = ["worker", "engine"] if args.level == "both" else [args.level]
    largest = max(args.batch_sizes)
    for level in chosen:
        for batch_size in args.batch_sizes:
            profile = args.profile and batch_size == largest
            stub = args.forward == "stub"
            if level == "worker":
                timed = worker_case(
                    batch_size, args.context, args.steps, stub, profile, args.multi_steps,
                    args.gc_freeze,
                )  # fmt: skip
            else:
                timed = engine_case(
                    batch_size, args.context, args.steps, stub, profile, args.gc_freeze,
                    args.multi_steps,
                )  # fmt: skip
            times = timed.times
            median = statistics.median(times)
            rec.emit(
                case="host_overhead", level=level, batch_size=batch_size, context=args.context,
                forward=args.forward, multi_steps=args.multi_steps,
                median_us=median * 1e6, mean_us=statistics.mean(times) * 1e6,
                min_us=min(times) * 1e6,
                max_us=max(times) * 1e6, samples=len(times),
                per_step_us=median * 1e6 / (args.multi_steps or 1),
                gc_collections=timed.gc_collections, gc_freeze=args.gc_freeze,
            )  # fmt: skip
    columns = ["level", "multi_steps", "batch_size", "context", "median_us", "per_step_us",
               "mean_us", "min_us", "max_us"]  # fmt: skip
    print(table(rec.rows, columns))


if __name__ == "__main__":
    main()
