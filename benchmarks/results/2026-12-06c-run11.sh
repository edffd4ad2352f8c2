#!/bin/bash
# Run 11 (twenty-first session): without MPS, can the receiver hide the GPU's switch from the
# sender's context behind its own host work, by submitting a little work first thing in a call
# (ipc_idle_gap.py --prods: an event record, a one-byte memset)?
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
P=$OUT/${RUN:-run11}
nvidia-smi > $P-nvidia-smi.txt 2>&1
timeout 300 python3 benchmarks/ipc_idle_gap.py --rounds 3 --gaps-us 1000 --prods none,event,memset --out $P-idle-gap.jsonl > $P-idle-gap.log 2>&1; echo "rc=$?"
python3 - $P-idle-gap.jsonl <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if r["case"] == "ipc idle gap":
        print(r["prod"], r["sender"], r["gap"], "call", round(r["call_us"]), "host", round(r["host_us"]))
PY
tail -2 $P-idle-gap.log
