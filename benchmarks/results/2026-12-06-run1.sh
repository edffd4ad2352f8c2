#!/bin/bash
# Run 1 (nineteenth session). Issue 13: what each CUDA call of an IPC bucket's receive costs the
# host (ipc_primitives.py), the receiver's stages at 512 MiB on this card (ipc_stages.py), and
# the host's Python speed (ipc_host.py, the CPU-only receive, to compare with the CI machine's).
# .ab/base was `git archive cebc91e dormant benchmarks` (the session's starting commit), carried.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
P=$OUT/${RUN:-2026-12-06-run1}
nvidia-smi > $P-nvidia-smi.txt 2>&1
timeout 120 python3 benchmarks/ipc_primitives.py --out $P-primitives.jsonl > $P-primitives.log 2>&1; echo "rc=$?" >> $P-primitives.log
timeout 120 python3 benchmarks/ipc_host.py --refits 10 --out $P-ipc-host.jsonl > $P-ipc-host.log 2>&1; echo "rc=$?" >> $P-ipc-host.log
# The receiver's stages and refit.py at 512 MiB, the committed tree (.ab/base: HEAD before this
# session's changes) and the working tree (the framed head, no slice of a whole bucket) in turn.
for tree in .ab/base .; do
  name=$([[ $tree == . ]] && echo new || echo base)
  timeout 100 python3 $tree/benchmarks/ipc_stages.py --bucket-mib 512 --synced --refits 3 --modes new,reuse --out $P-ipc-stages-$name.jsonl >> $P-ipc-stages.log 2>&1; echo "rc=$? $name" >> $P-ipc-stages.log
done
for tree in .ab/base . .ab/base .; do
  name=$([[ $tree == . ]] && echo new || echo base)
  timeout 90 python3 $tree/benchmarks/refit.py --bucket-mib 512 --repeats 3 --out $P-refit-$name.jsonl >> $P-refit.log 2>&1; echo "rc=$? $name" >> $P-refit.log
done
grep -v '^{' $P-primitives.log
grep -E '"stage": "(read|copy|call|llm call)"' $P-ipc-host.log | cut -c1-160
grep rc= $P-ipc-stages.log $P-refit.log
python3 - $P-refit-base.jsonl $P-refit-new.jsonl <<'PY'
import json, sys
for path in sys.argv[1:]:
    for line in open(path):
        r = json.loads(line)
        if r["case"].startswith(("ipc buckets of 512 MiB, a new", "ipc buckets of 512 MiB, one reused")):
            print(path[-10:-6], r["case"][23:45], "engine", round(r["engine_of_limit"], 3), "end to end", round(r["of_limit"], 3))
PY
python3 - $P-ipc-stages-base.jsonl $P-ipc-stages-new.jsonl <<'PY'
import json, sys
for path in sys.argv[1:]:
    for line in open(path):
        r = json.loads(line)
        if r["case"] == "ipc receiver stage" and r["stage"] in ("read", "copy", "sync", "copy on device", "whole call"):
            print(f'{path[-10:-6]} {r["sender"]:6} {r["stage"]:15} med={r["median_ms"]:.3f} mean={r["mean_ms"]:.3f} p90={r["p90_ms"]:.3f}')
PY
# Issue 16: can a read-only pass beat the copy bandwidth that the rollout's roofline uses (the
# decode attention reads its KV at 1.02 x that rate)? 8 GiB of bf16: a copy, and a sum.
python3 - <<'PY' 2>&1 | tee $P-read-bandwidth.log
import torch, triton
x = torch.randn(4 << 30, dtype=torch.bfloat16, device="cuda"); y = torch.empty_like(x)
n = x.numel() * 2
copy = triton.testing.do_bench(lambda: y.copy_(x), warmup=100, rep=1000, return_mode="median")
red = triton.testing.do_bench(lambda: x.sum(dtype=torch.float32), warmup=100, rep=1000, return_mode="median")
print(f"copy {2 * n / copy / 1e6:.0f} GB/s (read+write), sum {n / red / 1e6:.0f} GB/s (read); ms {copy:.3f} {red:.3f}")
PY
# The device tool brings back at most 8 files.
tar -C "$OUT" -czf /tmp/run1.tgz . && find "$OUT" -mindepth 1 -delete && mv /tmp/run1.tgz "$OUT/"
