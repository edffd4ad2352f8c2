"""Speculative decoding at batch 1 on the 8B-like model (random weights), and sleep/wake of the
target plus its draft.

Cases (each its own engine, one after the other; ``cuda_graph_multi_steps`` 4 unless said):
- ``none``: no speculation (the target's decodes replay the fused 4-step graph);
- ``self k=3 rounds``: self-speculation (the draft is a second copy of the target): every draft
  is accepted, the best case of a draft this size; its decodes run 4 speculative rounds per
  replay of the fused rounds' graph (``worker/spec_rounds.py``);
- ``self k=3``: the same, one round per step (``cuda_graph_multi_steps=1``): the draft's passes
  and the verification replay their own graphs, the host between them;
- ``self k=3 eager``: one round per step with ``enforce_eager`` in the speculative config (what
  the draft's and the verification's graphs save);
- ``small k=3 rounds`` and ``small k=3``: a 0.6B-like random draft with the target's
  vocabulary: its drafts are almost always rejected, so these measure what a rejected draft
  costs, with and without the fused rounds.

Decode tokens/s: one greedy request with a ``--context``-token prompt; the time of
``max_tokens=1 + N`` less the time of ``max_tokens=1`` (the prefill), over N tokens; median of
``--repeats``. ``rounds_replays`` counts the fused rounds' replays (0 where they are off).

Sleep/wake (every engine but the eager and the one-round ones; "none" is the target alone):
level 1, then level 2 with wake_up(["weights"]), ``reload_weights`` (target and draft),
wake_up(["kv_cache"]), each as the memory layer times it and as wall time; then a generation,
whose acceptance rate must not change.

Usage: python benchmarks/spec_decode.py [--out results.jsonl] [--tokens 128] [--context 512]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import Recorder, environment, table, timed
from benchmarks.decode import QWEN3_8B_LIKE
from dormant import LLM, SamplingParams
from dormant.engine.spec_stats import SpecDecodeStats
from dormant.models import ModelConfig

QWEN3_0_6B_LIKE = {
    **QWEN3_8B_LIKE, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
    "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
}  # fmt: skip
MAX_MODEL_LEN = 4096


def make_engine(
    draft: dict[str, Any] | None, k: int, eager: bool = False, multi_steps: int = 4
) -> LLM:
    target = ModelConfig.from_dict(QWEN3_8B_LIKE)
    options: dict[str, Any] = dict(max_model_len=MAX_MODEL_LEN, max_num_seqs=8,
                                   gpu_memory_utilization=0.8,
                                   cuda_graph_multi_steps=multi_steps)  # fmt: skip
    if draft is not None:
        model = target if draft is QWEN3_8B_LIKE else ModelConfig.from_dict(draft)
        options["speculative_config"] = {
            "model": model,
            "num_speculative_tokens": k,
            "enforce_eager": eager,
        }
    return LLM(target, **options)


def decode_tokens_per_s(llm: LLM, context: int, num_tokens: int, repeats: int) -> float:
    vocab = llm.llm_engine.config.model_config.vocab_size
    prompt = [(i * 7919) % (vocab - 10) + 10 for i in range(context)]

    def run(max_tokens: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        return timed(lambda: llm.generate([prompt], params, use_tqdm=False))[0]

    run(1 + num_tokens)  # warm-up
    prefill = statistics.median(run(1) for _ in range(repeats))
    full = statistics.median(run(1 + num_tokens) for _ in range(repeats))
    return num_tokens / (full - prefill)


def rounds_replays(llm: LLM) -> int:
    spec_step = llm.llm_engine.executor.worker.steps.spec_step
    rounds = None if spec_step is None else spec_step.rounds
    return 0 if rounds is None else rounds.num_replays


def acceptance(llm: LLM) -> float | None:
    stats = llm.llm_engine.spec_decode_stats
    if stats is None:
        return None
    llm.llm_engine.spec_decode_stats = SpecDecodeStats()
    return stats.acceptance_rate


def sleep_wake(rec: Recorder, case: str, llm: LLM, context: int) -> None:
    worker = llm.llm_engine.executor.worker
    draft_bytes = 0
    if worker.draft is not None:
        draft_bytes = sum(p.numel() * p.element_size() for p in worker.draft.model.parameters())
    for level in (1, 2, 1, 2):
        sleep_wall, _ = timed(lambda lv=level: llm.sleep(level=lv))
        sleep = llm.memory_status()[0].last_sleep
        weights_wall, _ = timed(lambda: llm.wake_up(["weights"]))
        weights = llm.memory_status()[0].last_wake
        reload_wall = 0.0
        if level == 2:
            reload_wall, _ = timed(lambda: llm.collective_rpc("reload_weights"))
        kv_wall, _ = timed(lambda: llm.wake_up(["kv_cache"]))
        kv = llm.memory_status()[0].last_wake
        decode_tokens_per_s(llm, context, 32, 1)
        rec.emit(
            case=f"{case} sleep/wake level {level}", draft_bytes=draft_bytes,
            sleep_s=sleep.total_s, sleep_wall_s=sleep_wall, sleep_copied=sleep.bytes_copied,
            sleep_released=sleep.bytes_released, wake_weights_s=weights.total_s,
            wake_weights_wall_s=weights_wall, reload_wall_s=reload_wall, wake_kv_s=kv.total_s,
            wake_kv_wall_s=kv_wall, acceptance_after=acceptance(llm),
        )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("-k", type=int, default=3)
    args = parser.parse_args()
    rec = Recorder(args.out)
    rec.emit(case="environment", **environment())
    rows, baseline = [], None
    k = args.k
    cases = (("none", None, False, 4), (f"self k={k} rounds", QWEN3_8B_LIKE, False, 4),
             (f"self k={k}", QWEN3_8B_LIKE, False, 1),
             (f"self k={k} eager", QWEN3_8B_LIKE, True, 1),
             (f"small k={k} rounds", QWEN3_0_6B_LIKE, False, 4),
             (f"small k={k}", QWEN3_0_6B_LIKE, False, 1))  # fmt: skip
    for case, draft, eager, multi_steps in cases:
        start = time.perf_counter()
        llm = make_engine(draft, k, eager, multi_steps)
        setup_s = time.perf_counter() - start
        try:
            speed = decode_tokens_per_s(llm, args.context, args.tokens, args.repeats)
            baseline = baseline or speed
            row = rec.emit(
                case=case, setup_s=setup_s, tokens_per_s=speed, x_none=speed / baseline,
                acceptance=acceptance(llm), num_blocks=llm.llm_engine.runtime.num_kv_blocks,
                rounds_replays=rounds_replays(llm),
            )  # fmt: skip
            rows.append(row)
            if multi_steps > 1:  # "none": the target's own, to compare
                sleep_wake(rec, case, llm, args.context)
        finally:
            llm.shutdown()
    print(table(rows, ["case", "tokens_per_s", "x_none", "acceptance", "rounds_replays",
                       "setup_s"]))  # fmt: skip


if __name__ == "__main__":
    main()
