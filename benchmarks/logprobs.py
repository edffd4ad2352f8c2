"""What logprobs cost a decode step of an 8B-like model (random weights) with CUDA graphs.

- batch-64 decode step (FULL graph, sampling after the replay) with ``logprobs=None``, ``0``
  and ``5`` (the three interleaved, round after round), greedy and seeded (temperature 0.8,
  top-p 0.9), target <= 1.05x the ``None`` step;
- the same in ``processed_logprobs`` mode (TRL's setting);
- the fused multi-step graph at batch 1 and 8, per token, with ``logprobs=None`` and ``5``
  (the graph carries logprobs either way, so the two should be equal).

Every step ends with its tokens and logprobs on the host (one event-guarded copy).

Usage: python benchmarks/logprobs.py [--out results.jsonl]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import Recorder, environment, table
from benchmarks.decode import QWEN3_8B_LIKE, time_steps
from dormant import LLM, SamplingParams
from dormant.core.step_input import SeqInput, StepInput
from dormant.models import ModelConfig

CONTEXT = 512
MAX_MODEL_LEN = 4096
PARAMS = {
    "greedy": {"temperature": 0.0},
    "seeded": {"temperature": 0.8, "top_p": 0.9, "seed": 1},
}


def decode_step(batch_size: int, block_size: int, params: SamplingParams) -> StepInput:
    blocks_per_seq = MAX_MODEL_LEN // block_size
    seqs = tuple(
        SeqInput(
            (11,),
            CONTEXT,
            tuple(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)),
            params,
            seed=i,
            num_output_tokens=1,
        )
        for i in range(batch_size)
    )
    return StepInput(seqs, is_prefill=False)


def interleaved_medians(run, steps: list[StepInput], rounds: int = 10) -> list[float]:
    """Median seconds of each step, run in turn in ``rounds`` rounds of 12 (the first 2 of each
    dropped), so that clock and thermal drift fall on every case alike."""
    samples: list[list[float]] = [[] for _ in steps]
    for _ in range(rounds):
        for sink, step in zip(samples, steps, strict=True):
            sink.extend(time_steps(run, step, repeats=12)[2:])
    return [statistics.median(sink) for sink in samples]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rec = Recorder(args.out)
    rec.emit(case="environment", **environment())
    rows = []
    for mode in ("raw_logprobs", "processed_logprobs"):
        llm = LLM(
            ModelConfig.from_dict(QWEN3_8B_LIKE),
            max_model_len=MAX_MODEL_LEN,
            max_num_seqs=64,
            gpu_memory_utilization=0.6,
            logprobs_mode=mode,
        )
        worker = llm.llm_engine.executor.worker
        block_size = llm.llm_engine.config.block_size
        for name, options in PARAMS.items():
            cases = (None, 0, 5)
            steps = [
                decode_step(64, block_size, SamplingParams(**options, logprobs=num_logprobs))
                for num_logprobs in cases
            ]
            medians = interleaved_medians(worker.execute, steps)
            for num_logprobs, step_s in zip(cases, medians, strict=True):
                rows.append(
                    rec.emit(
                        case="decode",
                        mode=mode,
                        params=name,
                        batch_size=64,
                        logprobs=num_logprobs,
                        step_s=step_s,
                        x_no_logprobs=step_s / medians[0],
                    )
                )
        if mode == "raw_logprobs":
            num_steps = llm.llm_engine.config.cuda_graph_multi_steps
            for batch_size in (1, 8):
                cases = (None, 5)
                steps = [
                    decode_step(batch_size, block_size, SamplingParams(temperature=0.0, logprobs=k))
                    for k in cases
                ]
                medians = interleaved_medians(worker.execute_multi_step, steps, rounds=5)
                for num_logprobs, step_s in zip(cases, medians, strict=True):
                    rows.append(
                        rec.emit(
                            case="decode multi-step",
                            mode=mode,
                            params="greedy",
                            batch_size=batch_size,
                            logprobs=num_logprobs,
                            step_s=step_s / num_steps,
                            x_no_logprobs=step_s / medians[0],
                        )
                    )
        llm.shutdown()
    print(
        table(
            rows,
            ["case", "mode", "params", "batch_size", "logprobs", "step_s", "x_no_logprobs"],
        )
    )


if __name__ == "__main__":
    main()
