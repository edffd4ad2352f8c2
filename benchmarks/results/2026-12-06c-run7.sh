#!/bin/bash
# Run 7 (twenty-first session): ipc_idle_gap.py without and with MPS on one machine, alternating
# twice (runs 4-6 compared them across machines).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
P=$OUT/${RUN:-run7}
nvidia-smi > $P-nvidia-smi.txt 2>&1
for round in 1 2; do
  timeout 100 python3 benchmarks/ipc_idle_gap.py --gaps-us 1000 --out $P-idle-gap-plain.jsonl > /dev/null 2>>$P-errors.log; echo "plain rc=$?"
  timeout 100 scripts/with_mps.sh python3 benchmarks/ipc_idle_gap.py --gaps-us 1000 --out $P-idle-gap-mps.jsonl > /dev/null 2>>$P-errors.log; echo "mps rc=$?"
done
for way in plain mps; do
python3 - $P-idle-gap-$way.jsonl $way <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if r["case"] == "ipc idle gap":
        print(sys.argv[2], r["sender"], r["gap"], r["gap_us"], "call", round(r["call_us"]), "host", round(r["host_us"]))
PY
done
tail -4 $P-errors.log
