"""Residual while asleep, and the zero-residual mode (issue 17, section 4); each case runs the first
engine of a fresh process.

    python benchmarks/residual.py [--out results.jsonl] [--cases eager full multi release]

The model is the issue's: a Qwen3 with hidden 1024 and 4 layers, bf16, random weights.

- ``eager`` / ``full`` / ``multi`` (no graphs; FULL graphs; FULL and 4-step fused graphs): the
  device memory in use at level 2 beyond what was in use before the engine was created (the
  child's CUDA context already made: ``cudaMemGetInfo`` right after ``torch.cuda.init``), torch's
  live allocations outside the tags, the census of the engine's object graph, and the memory
  status's attribution by owner. Target: <= 64 MiB with ``multi``.
- ``release``: ``multi`` with ``sleep(level=2, release_context=True)``, its second such cycle
  (the first also starts the checkpoint helper; its times are reported). While the child sleeps,
  this (parent) process reads NVML: the child's own device memory (driver accounting), and the
  device's. Then the child wakes (restore first), refits, and checks its tokens equal those
  before. Its costs are against a plain level-2 cycle of the same engine run just before.

The parent never touches CUDA. Each child prints JSON lines; the last is its result.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(ROOT))
MiB = 1 << 20
SMALL_QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"], "vocab_size": 32000, "hidden_size": 1024,
    "intermediate_size": 3072, "num_hidden_layers": 4, "num_attention_heads": 16,
    "num_key_value_heads": 8, "head_dim": 64, "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6, "rope_theta": 1e6, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "eos_token_id": 2,
}  # fmt: skip
CASES = ("eager", "full", "multi", "release")
TARGET_RESIDUAL_BYTES = 64 * MiB


# ── the parent ────────────────────────────────────────────────────────────────────────────────
def run_case(case: str, timeout_s: float = 900.0) -> dict[str, Any]:
    """Runs ``case`` in a fresh child process; returns its result (with the parent's NVML
    readings of the child while asleep, for ``release``). A child that passes ``timeout_s``,
    silent or not, is killed, and the error names the last phase it reported."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    child = subprocess.Popen(
        child_command(case),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )
    assert child.stdin is not None and child.stdout is not None
    lines: queue.Queue[str | None] = queue.Queue()
    threading.Thread(target=_pump, args=(child.stdout, lines), daemon=True).start()
    deadline, result, parent_view = time.monotonic() + timeout_s, None, None
    before_child: int | None = None
    last_phase = "start-up"
    while (line := _next_line(lines, deadline)) is not None:
        if line is _TIMED_OUT:
            child.kill()
            raise TimeoutError(f"case {case!r} took over {timeout_s} s, in {last_phase!r}")
        print(line, end="", flush=True)
        if not line.startswith("{"):
            continue
        event = json.loads(line)
        last_phase = event.get("phase", event.get("event", last_phase))
        if event.get("event") == "hello":  # no context in the child yet
            before_child = _device_used(event["pci_bus_id"])
            child.stdin.write("go\n")
            child.stdin.flush()
        elif event.get("event") == "asleep":
            parent_view = _read_nvml(event)
            print(json.dumps({"event": "parent_nvml", **parent_view}), flush=True)
            child.stdin.write("wake\n")
            child.stdin.flush()
        elif event.get("event") == "result":
            result = event
    code = child.wait()
    if result is None:
        raise RuntimeError(f"case {case!r}: the child exited with {code} and no result")
    if parent_view is not None:
        result["parent_nvml"] = {**parent_view, "device_used_before_child_bytes": before_child}
    return result


_TIMED_OUT = "<timed out>"


def child_command(case: str) -> list[str]:
    """The command that runs ``case`` in a fresh process (this file, as its child)."""
    return [sys.executable, str(Path(__file__).resolve()), "--child", case]


def _pump(stream: Any, lines: queue.Queue[str | None]) -> None:
    """Moves the child's output lines to ``lines``, then None at its end."""
    for line in stream:
        lines.put(line)
    lines.put(None)


def _next_line(lines: queue.Queue[str | None], deadline: float) -> str | None:
    """The child's next line, None at its end, ``_TIMED_OUT`` once ``deadline`` passed."""
    try:
        return lines.get(timeout=max(deadline - time.monotonic(), 0.0))
    except queue.Empty:
        return _TIMED_OUT


def _device_used(bus: str | None) -> int | None:
    from dormant.memory import nvml

    device = nvml.device_memory(bus) if bus else None
    return None if device is None else device.used_bytes


def _read_nvml(event: dict[str, Any]) -> dict[str, Any]:
    """NVML as another process sees the child asleep: its own memory (0 when the driver lists no
    context of it) if NVML lists our pids at all, and the device's used memory."""
    from dormant.memory import nvml

    bus, pid = event["pci_bus_id"], event["pid"]
    processes = nvml.compute_processes(bus) if bus else None
    return {
        "child_listed_while_awake": event["nvml_listed_while_awake"],
        "child_process_bytes": None if processes is None else processes.get(pid, 0),
        "processes": None if processes is None else {str(k): v for k, v in processes.items()},
        "device_used_bytes": _device_used(bus),
    }


# ── the child ─────────────────────────────────────────────────────────────────────────────────
def child_main(case: str) -> None:
    import faulthandler

    import torch

    from dormant.memory.residual import pci_bus_id_of

    faulthandler.dump_traceback_later(60, repeat=True)  # stderr: the stacks of a hang
    emit(event="hello", pci_bus_id=pci_bus_id_of(0))
    sys.stdin.readline()  # the parent read the device before this process had a context
    torch.cuda.init()
    free, total = torch.cuda.mem_get_info()  # the context exists from here on
    baseline = total - free
    from dormant import LLM, SamplingParams
    from dormant.memory import CheckpointUnsupportedError, nvml
    from dormant.memory.census import untagged_tensors
    from dormant.models import ModelConfig

    options: dict[str, Any] = dict(
        enable_sleep_mode=True, max_model_len=1024, max_num_seqs=32, seed=0,
        kv_cache_memory_bytes=512 * MiB, enforce_eager=case == "eager",
        cuda_graph_multi_steps=1 if case == "full" else 4,
    )  # fmt: skip
    start = time.perf_counter()
    llm = LLM(ModelConfig.from_dict(SMALL_QWEN3), **options)
    emit(event="started", case=case, start_s=time.perf_counter() - start)
    worker = llm.llm_engine.executor.worker
    prompts = [[11 + i, 200 + 7 * i, 3000 + i, 42, 17 * i + 5] for i in range(8)]
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)  # multi-step path
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=16, logprobs=2)

    def generate() -> list[Any]:
        out = llm.generate(prompts, greedy, use_tqdm=False)
        out += llm.generate(prompts, seeded, use_tqdm=False)
        return [o.outputs[0].token_ids for o in out]

    emit(event="phase", phase="generate before")
    before = generate()
    pid, bus = os.getpid(), worker.mm.residual.pci_bus_id
    awake_nvml = nvml.process_memory(bus, pid) if bus else None
    listed = bool(awake_nvml)
    result: dict[str, Any] = {"event": "result", "case": case, "baseline_used_bytes": baseline}

    if case == "release":
        plain_sleep, plain_wake = cycle(llm, release=False)
        try:  # the first release also starts the helper process: reported, not compared
            first_sleep, first_wake = cycle(llm, release=True)
        except CheckpointUnsupportedError as error:
            emit(**result, unsupported=str(error))
            return
        emit(event="phase", phase="measured release: sleep(level=2, release_context=True)")
        sleep_s, _ = timed(lambda: llm.sleep(level=2, release_context=True))
        asleep = llm.memory_status()[0]
        emit(event="asleep", pid=pid, pci_bus_id=bus, nvml_listed_while_awake=listed)
        sys.stdin.readline()  # the parent measures, then says wake
        emit(event="phase", phase="measured release: wake (restore first)")
        wake_s, _ = timed(lambda: llm.wake_up(["weights"]))
        llm.collective_rpc("reload_weights")
        wake_kv_s, _ = timed(lambda: llm.wake_up(["kv_cache"]))
        context = llm.memory_status()[0].context
        result.update(
            plain_sleep_s=plain_sleep, plain_wake_weights_s=plain_wake,
            first_release_sleep_s=first_sleep, first_release_wake_weights_s=first_wake,
            release_sleep_s=sleep_s, release_wake_weights_s=wake_s, wake_kv_s=wake_kv_s,
            extra_sleep_s=sleep_s - plain_sleep, extra_wake_s=wake_s - plain_wake,
            context=None if context is None else vars(context), status_asleep=asleep.table(),
            nvml_process_bytes_awake=awake_nvml,
        )  # fmt: skip
    else:
        sleep_s, _ = timed(lambda: llm.sleep(level=2))
        free, _ = torch.cuda.mem_get_info()
        status = llm.memory_status()[0]
        rows = {r.owner: r.nbytes for r in status.residual}
        outside = sum(n for owner, n in rows.items() if owner.startswith("torch: live"))
        census = [path for path, _ in untagged_tensors(worker, worker.mm)]
        live = [  # torch's live blocks outside the tags, for a failure to show
            block["size"]
            for segment in torch.cuda.memory_snapshot()
            if worker.mm.tag_of(segment["address"]) is None
            for block in segment["blocks"]
            if block["state"] == "active_allocated"
        ]
        result.update(
            sleep_s=sleep_s, residual_bytes=(total - free) - baseline,
            torch_outside_tags_allocated_bytes=outside,
            torch_memory_allocated_bytes=torch.cuda.memory_allocated(),
            census=census, residual_rows=rows, status_asleep=status.table(),
            live_blocks_outside_tags=sorted(live, reverse=True)[:20],
            released={r.owner: r.nbytes for r in status.released},
        )  # fmt: skip
        llm.wake_up(["weights"])
        llm.collective_rpc("reload_weights")
        llm.wake_up(["kv_cache"])
    result["tokens_equal"] = generate() == before
    llm.shutdown()
    emit(**result)


def cycle(llm: Any, release: bool) -> tuple[float, float]:
    """One level-2 cycle: (sleep seconds, wake-weights seconds); refit, then wake the KV. Each
    step is announced first, so a parent that times out knows where."""
    kind = "release" if release else "plain"
    emit(event="phase", phase=f"{kind} cycle: sleep(level=2)")
    sleep_s, _ = timed(lambda: llm.sleep(level=2, release_context=release))
    emit(event="phase", phase=f"{kind} cycle: wake the weights")
    wake_s, _ = timed(lambda: llm.wake_up(["weights"]))
    emit(event="phase", phase=f"{kind} cycle: refit, wake the KV")
    llm.collective_rpc("reload_weights")
    llm.wake_up(["kv_cache"])
    return sleep_s, wake_s


def timed(fn: Any) -> tuple[float, Any]:
    start = time.perf_counter()
    value = fn()
    return time.perf_counter() - start, value


def emit(**row: Any) -> None:
    print(json.dumps(row, default=str), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", choices=CASES, help=argparse.SUPPRESS)
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.child:
        child_main(args.child)
        return
    results = [run_case(case) for case in args.cases]
    if args.out:
        with open(args.out, "a") as f:
            f.writelines(json.dumps(r, default=str) + "\n" for r in results)
    print("\ncase      residual MiB   torch outside tags MiB   tokens equal")
    for r in results:
        if r["case"] == "release":
            nvml_view = r.get("parent_nvml", {})
            print(
                f"release   child per NVML while asleep: {nvml_view.get('child_process_bytes')} B;"
                f" extra sleep {r.get('extra_sleep_s', float('nan')) * 1e3:.0f} ms, extra wake "
                f"{r.get('extra_wake_s', float('nan')) * 1e3:.0f} ms; {r.get('unsupported', '')}"
                f" tokens equal {r.get('tokens_equal')}"
            )
            continue
        print(
            f"{r['case']:<9} {r['residual_bytes'] / MiB:>12.1f}   "
            f"{r['torch_outside_tags_allocated_bytes'] / MiB:>22.1f}   {r['tokens_equal']}"
        )


if __name__ == "__main__":
    main()
