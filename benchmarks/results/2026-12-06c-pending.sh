#!/bin/bash
# What the twenty-first session asked of an H200 twice and got no machine for (needs_h200), for
# `scripts/gpu_suite.sh pending` (~9 min: it stops on another card). Issue 16's rollout holds 64 x 8
# sequences of 1,024 tokens with caching off, about 77 GB of KV beside 16 GB of weights, which an
# H100 cannot hold (it preempted and recomputed: 424k prefill tokens instead of 262k, run 4 of
# 2026-12-06b). With it: the overlap probe with SM carveouts at batch 512 and 256 (does a
# two-stream way beat one batch where batch-256 GEMMs are compute-bound?), and refit.py at
# 512 MiB without and with MPS (scripts/with_mps.sh).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
P=$OUT/${RUN:-pending}
nvidia-smi > $P-nvidia-smi.txt 2>&1
if ! nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then echo "not an H200: stop"; exit 3; fi
timeout 150 python3 benchmarks/overlap_probe.py --batch-sizes 512,256 --carveouts 32,48 --out $P-overlap.jsonl > $P-overlap.log 2>&1; echo "rc=$?" >> $P-overlap.log
grep -v '^{' $P-overlap.log | tail -22
refit=(benchmarks/refit.py --bucket-mib 512 --repeats 3 --modes new,reuse)
timeout 60 python3 "${refit[@]}" --out $P-refit-plain.jsonl > $P-refit.log 2>&1; echo "plain rc=$?" >> $P-refit.log
timeout 60 scripts/with_mps.sh python3 "${refit[@]}" --out $P-refit-mps.jsonl >> $P-refit.log 2>&1; echo "mps rc=$?" >> $P-refit.log
grep "rc=\|with_mps" $P-refit.log
for way in plain mps; do
python3 - $P-refit-$way.jsonl $way <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if r["case"].startswith("ipc buckets"):
        print(sys.argv[2], r["case"][23:45], "engine", round(r["engine_of_limit"], 3), "end to end", round(r["of_limit"], 3), "verified", r["verified"])
PY
done
timeout 270 python3 benchmarks/rollout.py --multi-steps 4 --async-scheduling on --cycles 0 --out $P-rollout.jsonl > $P-rollout.log 2>&1; echo "rc=$?" >> $P-rollout.log
grep -v '^{' $P-rollout.log | tail -20
