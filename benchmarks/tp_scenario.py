"""Issue 20's scenario at TP=N: the cycle the system this project grew from was verified on.

The engine (random weights, a MoE model with self-speculation by default, or MiMo with its MTP
layers: dormant builds MTP for MiMo only) runs, ``--cycles`` times with the level alternating
2, 1, 2, ...:

    generate → sleep(level) → wake_up(["weights"]) → collective_rpc("reload_weights") (level 2)
             → wake_up(["kv_cache"]) → generate

and checks after every cycle that the tokens equal the first generate's, that every rank's
guarded addresses are unchanged (``verify_guards`` on every rank: it raises
``PointerGuardError`` when a graph-visible address moved) and that the
speculative acceptance rate is the first generate's. Every checked generate starts from the same
prefix cache: the cycle's sleep invalidated it and its one-token first decode cached the prompts'
full blocks, so the reference is made after ``reset_prefix_cache()`` and a one-token generate too
(a prefill over cached blocks is not bitwise the full prefill in bf16, and random weights' flat
logits turn that into other tokens); ``control_equal`` says whether a second reference, made the
same way before any cycle, equals the first, ``same_cache`` whether a cycle's generate found as
many cached prompt tokens as the reference (both required), and ``cold_equal`` whether the same
generate on an empty cache equals the reference (not required). Per cycle it prints the
driver's seconds for each step (sleep, wake weights, reload, wake KV, first decode: a one-token
generate) and, per rank, the memory layer's own sleep and wake seconds, what the sleep spent
growing the host arena and copying, and the residual while asleep by owner (the NCCL
communicator's row included; ``--comm-sleep`` suspends or re-creates it). On a GPU the decode
runs FULL and fused multi-step graphs; ``--tiny`` runs a tiny model at TP=2 over gloo on
the CPU (eager), which checks the script, not the figures.

The prior art's figures on 4 x H200 at TP=4 (a MoE with MTP, FULL graphs): sleep 0.507 s, wake
weights 0.455 s, wake KV 1.132 s, first decode 0.121 s.

    python benchmarks/tp_scenario.py [--tp 4] [--cycles 3] [--spec self|mtp|none]
        [--layers 12] [--comm-sleep off|suspend|recreate] [--tiny] [--out scenario.jsonl]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import Recorder, table
from benchmarks.moe import QWEN3_30B_A3B
from dormant import LLM, SamplingParams
from dormant.models import ModelConfig

MIMO = {
    "architectures": ["MiMoForCausalLM"], "vocab_size": 151680, "hidden_size": 4096,
    "intermediate_size": 11008, "num_hidden_layers": 36, "num_attention_heads": 32,
    "num_key_value_heads": 8, "max_position_embeddings": 32768, "rms_norm_eps": 1e-5,
    "rope_theta": 640000, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "num_nextn_predict_layers": 1, "attention_bias": True,
}  # fmt: skip
TINY = {
    "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "moe_intermediate_size": 32, "num_experts": 8,
    "num_experts_per_tok": 2, "max_position_embeddings": 512, "torch_dtype": "float32",
}  # fmt: skip
PROMPTS = [[(7 * i + 3 * j) % 200 + 10 for j in range(24 + 8 * i)] for i in range(4)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
FIRST = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
PRIOR_ART = {"sleep_s": 0.507, "wake_weights_s": 0.455, "wake_kv_s": 1.132, "first_decode_s": 0.121}


def model_config(args: argparse.Namespace) -> ModelConfig:
    base = MIMO if args.spec == "mtp" else QWEN3_30B_A3B
    overrides = {"num_hidden_layers": args.layers}
    if args.tiny:
        overrides = {**TINY, "num_hidden_layers": 2}
    return ModelConfig.from_dict({**base, **overrides})


def build(args: argparse.Namespace, config: ModelConfig) -> LLM:
    spec: dict[str, Any] | None = None
    if args.spec == "self":
        spec = {"model": config, "num_speculative_tokens": 3}
    elif args.spec == "mtp":
        spec = {"method": "mtp", "num_speculative_tokens": 1}
    device = {"device": "cpu", "enforce_eager": True} if args.tiny else {"device": "cuda"}
    return LLM(
        config, tensor_parallel_size=args.tp, speculative_config=spec, max_model_len=512,
        max_num_seqs=8, kv_cache_memory_bytes=args.kv_mib << 20, comm_sleep=args.comm_sleep,
        skip_tokenizer_init=True, **device,
    )  # fmt: skip


class Generated(NamedTuple):
    tokens: list[tuple[int, ...]]
    rate: float | None  # the acceptance rate of this call's drafts (None: none)
    cached_tokens: int  # the prompts' tokens the prefix cache held when it ran


def generate(llm: LLM, params: SamplingParams) -> Generated:
    stats = llm.llm_engine.spec_decode_stats
    before = (stats.num_draft_tokens, stats.num_accepted_tokens) if stats else (0, 0)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    drafts = stats.num_draft_tokens - before[0] if stats else 0
    rate = (stats.num_accepted_tokens - before[1]) / drafts if stats and drafts else None
    cached = sum(o.num_cached_tokens for o in outputs)
    return Generated([o.outputs[0].token_ids for o in outputs], rate, cached)


def timed(fn: Any, *args: Any) -> tuple[float, Any]:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    result = fn(*args)
    return time.perf_counter() - start, result


def cycle(llm: LLM, level: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """One cycle at ``level``: the driver's seconds per step, and per rank what its memory
    layer measured (the weights' wake is read right after it, the KV's at the end)."""
    row: dict[str, Any] = {"level": level}
    row["sleep_s"], _ = timed(llm.sleep, level)
    asleep = llm.memory_status()
    row["wake_weights_s"], _ = timed(llm.wake_up, ["weights"])
    weights_woken = llm.memory_status()
    row["reload_s"] = timed(llm.collective_rpc, "reload_weights")[0] if level == 2 else None
    row["wake_kv_s"], _ = timed(llm.wake_up, ["kv_cache"])
    row["first_decode_s"], _ = timed(generate, llm, FIRST)
    awake = llm.memory_status()
    ranks = []
    for rank, (slept, weights, kv) in enumerate(zip(asleep, weights_woken, awake, strict=True)):
        ranks.append({
            "rank": rank, "level": level,
            "sleep_s": slept.last_sleep.total_s if slept.last_sleep else None,
            "wake_weights_s": weights.last_wake.total_s if weights.last_wake else None,
            "wake_kv_s": kv.last_wake.total_s if kv.last_wake else None,
            **sleep_parts(slept.last_sleep),
            "residual_bytes": sum(item.nbytes for item in slept.residual),
            "residual": {item.owner: item.nbytes for item in slept.residual},
            "device_used_asleep_bytes": slept.device_used_bytes,
        })  # fmt: skip
    return row, ranks


def sleep_parts(report: Any) -> dict[str, Any]:
    """Where a rank's sleep went: growing the host arena (the background preparation not done
    yet, or too small), hashing, copying."""
    if report is None:
        return {}
    return {
        "sleep_arena_s": report.arena_s, "sleep_hash_s": report.hash_s,
        "sleep_copy_s": report.copy_s, "sleep_bytes_copied": report.bytes_copied,
    }  # fmt: skip


def reference(llm: LLM) -> Generated:
    """The tokens from the prefix cache a cycle leaves: only the prompts' full blocks cached."""
    llm.reset_prefix_cache()
    generate(llm, FIRST)
    return generate(llm, GREEDY)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=None, help="default: every visible GPU (2 CPU)")
    parser.add_argument("--cycles", type=int, default=3)
    parser.add_argument("--spec", choices=("self", "mtp", "none"), default="self")
    parser.add_argument("--layers", type=int, default=12, help="the model's layers (GPU)")
    parser.add_argument("--kv-mib", type=int, default=256, help="KV cache per rank, MiB")
    parser.add_argument("--comm-sleep", choices=("off", "suspend", "recreate"), default="off")
    parser.add_argument("--tiny", action="store_true", help="a tiny model at TP=2 on the CPU")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.tp is None:
        args.tp = 2 if args.tiny else torch.cuda.device_count()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off (the device's rule)
    os.environ.setdefault("NCCL_GRAPH_REGISTER", "0")  # tests/gpu/test_tp_gpu.py says why
    recorder = Recorder(args.out)
    config = model_config(args)
    recorder.emit(
        case="setup", tp=args.tp, spec=args.spec, architecture=config.architecture,
        layers=config.num_hidden_layers, comm_sleep=args.comm_sleep, torch=torch.__version__,
        gpus=[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        prior_art=PRIOR_ART,
    )  # fmt: skip
    with build(args, config) as llm:
        expected = reference(llm)
        control_equal = reference(llm) == expected
        llm.reset_prefix_cache()  # the same prompts on an empty cache: every block computed
        cold = generate(llm, GREEDY)
        recorder.emit(
            case="control", control_equal=control_equal, cold_equal=cold.tokens == expected.tokens,
            cached_tokens=expected.cached_tokens, cold_cached_tokens=cold.cached_tokens,
        )  # fmt: skip
        rows = []
        for index in range(args.cycles):
            row, ranks = cycle(llm, 2 if index % 2 == 0 else 1)
            llm.collective_rpc("verify_guards")  # raises if any rank's guarded address moved
            got = generate(llm, GREEDY)
            row.update(
                cycle=index, tokens_equal=got.tokens == expected.tokens, acceptance=got.rate,
                acceptance_equal=got.rate == expected.rate, cached_tokens=got.cached_tokens,
                same_cache=got.cached_tokens == expected.cached_tokens,
            )  # fmt: skip
            rows.append(recorder.emit(case="cycle", **row))
            for rank in ranks:
                recorder.emit(case="rank", cycle=index, **rank)
    print(table(rows, ["cycle", "level", *PRIOR_ART, "reload_s", "tokens_equal",
                       "acceptance"]))  # fmt: skip
    if not control_equal or not all(r["same_cache"] for r in rows):
        raise SystemExit(
            "the reference and the checked generates differ in how they were made (two "
            "references, or the prefix cache each found): the cycles' check means nothing"
        )
    if not all(r["tokens_equal"] and r["acceptance_equal"] for r in rows):
        raise SystemExit("a cycle changed the tokens or the acceptance rate")


if __name__ == "__main__":
    main()
