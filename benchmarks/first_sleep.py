"""The engine's first level-1 sleep, and what preparing its host arena in the background costs the
first generate (issue 17, section 2: first sleep <= 1.2 x a steady-state one, the first generate
delayed by <= 5 %).

Each run is a fresh process (the arena, Triton's caches in memory and the CUDA context are all
per process) with the 8B-like engine of decode.py: build it, generate at once (the arena, if
prepared, is being pinned in the background then), wait for the preparation, generate again, then
sleep at level 1 three times (weights changed before each, as a refit changes them; wake after a
trainer step). Runs alternate ``prepare_sleep_arena=True`` and ``False`` (the first sleep pins
the arena itself), after one warm-up run that fills Triton's on-disk cache, so that compile time
lands in neither.

Usage: python benchmarks/first_sleep.py [--out results.jsonl] [--runs 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import Recorder, environment, table

NUM_PROMPTS, PROMPT_LEN, MAX_TOKENS = 64, 128, 128
TRAINER_STEP_S = 0.25


def child(prepare: bool) -> dict:
    import torch

    from benchmarks.decode import QWEN3_8B_LIKE
    from dormant import LLM, SamplingParams
    from dormant.models import ModelConfig

    start = time.perf_counter()
    llm = LLM(ModelConfig.from_dict(QWEN3_8B_LIKE), max_model_len=4096, max_num_seqs=64,
              gpu_memory_utilization=0.6, prepare_sleep_arena=prepare)  # fmt: skip
    built = time.perf_counter()
    worker = llm.llm_engine.executor.worker
    prompts = [{"prompt_token_ids": [(7 * i + j) % 150000 + 10 for j in range(PROMPT_LEN)]}
               for i in range(NUM_PROMPTS)]  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

    def generate() -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t0

    first = generate()
    preparation = worker.mm.arena.preparation
    was_running = preparation is not None and not preparation.is_done
    if preparation is not None:
        preparation.wait()
    second = generate()
    sleeps = []
    for _ in range(3):
        for p in worker.model.parameters():
            p.data.view(-1)[0] += 1
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        llm.sleep(level=1)
        sleeps.append(time.perf_counter() - t0)
        report = llm.memory_status()[0].last_sleep
        time.sleep(TRAINER_STEP_S)
        llm.wake_up()
    result = {
        "prepare": prepare, "build_s": built - start, "first_generate_s": first,
        "second_generate_s": second, "preparation_running_during_first": was_running,
        "preparation_s": None if preparation is None else preparation.seconds,
        "preparation_bytes": None if preparation is None else preparation.nbytes,
        "sleeps_s": sleeps, "last_sleep_copied": report.bytes_copied,
    }  # fmt: skip
    llm.shutdown()
    return result


def run_child(prepare: bool) -> dict:
    command = [sys.executable, __file__, "--child", "prepare" if prepare else "none"]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"child failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--runs", type=int, default=2, help="runs of each mode, alternated")
    parser.add_argument("--child", choices=("prepare", "none"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child == "prepare")))
        return
    rec = Recorder(args.out)
    rec.emit(case="environment", **environment())
    run_child(True)  # warm-up: Triton compiles to its on-disk cache
    results: dict[bool, list[dict]] = {True: [], False: []}
    for _ in range(args.runs):
        for prepare in (True, False):
            result = run_child(prepare)
            results[prepare].append(rec.emit(case="first sleep run", **result))
    rows = []
    for prepare, runs in results.items():
        rows.append({
            "arena": "prepared in the background" if prepare else "pinned at the first sleep",
            "first_generate_s": statistics.median(r["first_generate_s"] for r in runs),
            "second_generate_s": statistics.median(r["second_generate_s"] for r in runs),
            "first_sleep_s": statistics.median(r["sleeps_s"][0] for r in runs),
            "steady_sleep_s": statistics.median(s for r in runs for s in r["sleeps_s"][1:]),
        })  # fmt: skip
    for row in rows:
        row["first_over_steady"] = row["first_sleep_s"] / row["steady_sleep_s"]
    prepared, pinned_late = rows
    delay = prepared["first_generate_s"] / pinned_late["first_generate_s"]
    rec.emit(case="ratio", name="first generate: prepared / not", value=delay,
             target_at_most=1.05, is_met=delay <= 1.05)  # fmt: skip
    ratio = prepared["first_over_steady"]
    rec.emit(case="ratio", name="engine first sleep / steady sleep (prepared)", value=ratio,
             target_at_most=1.2, is_met=ratio <= 1.2)  # fmt: skip
    print(table(rows, ["arena", "first_generate_s", "second_generate_s", "first_sleep_s",
                       "steady_sleep_s", "first_over_steady"]))  # fmt: skip
    print(f"first generate, prepared / not: {delay:.3f} (target <= 1.05)")


if __name__ == "__main__":
    main()
