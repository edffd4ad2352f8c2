#!/bin/bash
# Run 3 (twenty-first session): issue 13's per-bucket host time, back to back against after an
# idle gap (ipc_idle_gap.py): is it the receiver's code or the host's state after a wait?
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
P=$OUT/${RUN:-run3}
nvidia-smi > $P-nvidia-smi.txt 2>&1
timeout 400 python3 benchmarks/ipc_idle_gap.py --rounds 3 --gaps-us 200,1000,5000 --out $P-idle-gap.jsonl > $P-idle-gap.log 2>&1; echo "rc=$?" >> $P-idle-gap.log
python3 - $P-idle-gap.jsonl <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if r["case"] == "ipc idle gap":
        print(r["sender"], r["gap"], r["gap_us"], "call", round(r["call_us"]), "copy", round(r["copy_us"]), "host", round(r["host_us"]), "p90", round(r["p90_call_us"]))
PY
tail -3 $P-idle-gap.log
