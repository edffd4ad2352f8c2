#!/bin/bash
# Run 7 (sixteenth session): issue 13, where the IPC receiver's host time goes on the H200 host:
# reading a bucket's entry took 0.13-0.22 ms there (run 4) against about 0.02 ms of Python on the
# CI CPU (benchmarks/ipc_host.py). ipc_stages with cProfile around the whole calls, the reused
# buffer (verl's way) and a new buffer each (slime's), then the same without the profiler.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
P=$OUT/2026-12-04-run7
timeout 120 python3 benchmarks/ipc_stages.py --synced --refits 3 --modes reuse,new --profile --out $P-ipc-stages.jsonl > $P-ipc-stages-profile.log 2>&1; echo "rc=$?" >> $P-ipc-stages-profile.log
grep -A32 "^== " $P-ipc-stages-profile.log | cut -c1-150
