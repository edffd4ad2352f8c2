#!/bin/bash
# Run 2 (twenty-first session), asked of an H200 (needs_h200): issue 16's rollout holds 64 x 8
# sequences of 1,024 tokens with caching off, about 77 GB of KV beside 16 GB of weights, which an
# H100 cannot hold (it preempted and recomputed: 424k prefill tokens instead of 262k, run 4 of
# 2026-12-06b). With it, what the twentieth session left for an H200: the overlap probe with SM
# carveouts at batch 512 and 256 (does a two-stream way beat one batch where batch-256 GEMMs are
# compute-bound?) and refit.py at 512 MiB twice (this receiver's engine side on an H200).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
P=$OUT/${RUN:-run2}
nvidia-smi > $P-nvidia-smi.txt 2>&1
if ! nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then echo "not an H200: stop"; exit 3; fi
RUN=run2 timeout 290 bash benchmarks/results/2026-12-06b-pending.sh
timeout 280 python3 benchmarks/rollout.py --multi-steps 4 --async-scheduling on --cycles 0 --out $P-rollout.jsonl > $P-rollout.log 2>&1; echo "rc=$?" >> $P-rollout.log
grep -v '^{' $P-rollout.log | tail -30
