#!/bin/bash
# Run 10 (twenty-first session): refit.py's pipelined sender (bucket k+1 packed into the other
# half of its buffer while the engine copies bucket k) against the reused buffer, without and with
# MPS, alternating twice. Without MPS the GPU time-slices the two processes, so the pack and the
# copy cannot overlap; under MPS they share one context and can.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
P=$OUT/${RUN:-run10}
nvidia-smi > $P-nvidia-smi.txt 2>&1
refit=(benchmarks/refit.py --bucket-mib 512 --repeats 3 --modes reuse,pipelined)
for round in 1 2; do
  timeout 70 python3 "${refit[@]}" --out $P-refit-plain.jsonl > /dev/null 2>>$P-errors.log; echo "plain rc=$?"
  timeout 70 scripts/with_mps.sh python3 "${refit[@]}" --out $P-refit-mps.jsonl > /dev/null 2>>$P-errors.log; echo "mps rc=$?"
done
for way in plain mps; do
python3 - $P-refit-$way.jsonl $way <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if r["case"].startswith("ipc buckets"):
        print(sys.argv[2], r["case"][23:50], "engine", round(r["engine_of_limit"], 3), "end to end", round(r["of_limit"], 3), "verified", r["verified"])
PY
done
grep -v "^with_mps" $P-errors.log | tail -3
