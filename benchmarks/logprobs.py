"""What logprobs cost a decode step of an 8B-like model (random weights) with CUDA graphs.

- batch-64 decode step (FULL graph, sampling after the replay) with ``logprobs=None``, ``0``
  and ``5``, greedy and seeded (temperature 0.8, top-p 0.9), target <= 1.05x the ``None`` step;
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


def median_step(run, step: StepInput) -> float:
    return statistics.median(time_steps(run, step)[3:])


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
            base = None
            for num_logprobs in (None, 0, 5):
                params = SamplingParams(**options, logprobs=num_logprobs)
                step_s = median_step(worker.execute, decode_step(64, block_size, params))
                base = base or step_s
                rows.append(
                    rec.emit(
                        case="decode",
                        mode=mode,
                        params=name,
                        batch_size=64,
                        logprobs=num_logprobs,
                        step_s=step_s,
                        x_no_logprobs=step_s / base,
                    )
                )
        if mode == "raw_logprobs":
            num_steps = llm.llm_engine.config.cuda_graph_multi_steps
            for batch_size in (1, 8):
                base = None
                for num_logprobs in (None, 5):
                    params = SamplingParams(temperature=0.0, logprobs=num_logprobs)
                    step = decode_step(batch_size, block_size, params)
                    per_token = median_step(worker.execute_multi_step, step) / num_steps
                    base = base or per_token
                    rows.append(
                        rec.emit(
                            case="decode multi-step",
                            mode=mode,
                            params="greedy",
                            batch_size=batch_size,
                            logprobs=num_logprobs,
                            step_s=per_token,
                            x_no_logprobs=per_token / base,
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
