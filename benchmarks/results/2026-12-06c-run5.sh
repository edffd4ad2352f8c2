#!/bin/bash
# Run 5 (twenty-first session): run 4 found that a bucket's call costs ~150 us more when the
# sender's process ran GPU work just before it (a context switch between the two processes'
# CUDA contexts), against 33-46 us of the receiver's own host work. Under MPS both processes'
# work shares one context on the GPU. refit.py without MPS (new, reuse and direct: the trainer's
# own tensors, no packing, so no sender GPU work between buckets), then MPS started (user-space
# daemon; the GPU's compute mode is not changed), ipc_idle_gap.py and refit.py under it, MPS quit.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
P=$OUT/${RUN:-run5}
nvidia-smi > $P-nvidia-smi.txt 2>&1
summary() {
python3 - $1 <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if r["case"].startswith("ipc buckets"):
        print(r["case"][23:45], "engine", round(r["engine_of_limit"], 3), "end to end", round(r["of_limit"], 3), "verified", r["verified"])
    if r["case"] == "ipc idle gap":
        print(r["sender"], r["gap"], r["gap_us"], "call", round(r["call_us"]), "host", round(r["host_us"]))
PY
}
echo "== without MPS"
timeout 120 python3 benchmarks/refit.py --bucket-mib 512 --repeats 3 --modes new,reuse,direct --out $P-refit-plain.jsonl > $P-refit-plain.log 2>&1; echo "rc=$?" >> $P-refit-plain.log
summary $P-refit-plain.jsonl
MPS=$(command -v nvidia-cuda-mps-control) || { echo "no nvidia-cuda-mps-control on this machine"; exit 0; }
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
$MPS -d; echo "mps started rc=$?"
echo "== under MPS"
timeout 150 python3 benchmarks/ipc_idle_gap.py --rounds 3 --gaps-us 1000 --out $P-idle-gap-mps.jsonl > $P-idle-gap-mps.log 2>&1; echo "rc=$?" >> $P-idle-gap-mps.log
tail -2 $P-idle-gap-mps.log; summary $P-idle-gap-mps.jsonl
timeout 120 python3 benchmarks/refit.py --bucket-mib 512 --repeats 3 --modes new,reuse,direct --out $P-refit-mps.jsonl > $P-refit-mps.log 2>&1; echo "rc=$?" >> $P-refit-mps.log
tail -2 $P-refit-mps.log; summary $P-refit-mps.jsonl
ps aux | grep -c "[n]vidia-cuda-mps-server" | sed 's/^/mps servers: /'
cp $CUDA_MPS_LOG_DIRECTORY/control.log $P-mps-control.log 2>/dev/null
echo quit | $MPS; echo "mps quit rc=$?"
