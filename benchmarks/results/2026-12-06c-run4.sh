#!/bin/bash
# Run 4 (twenty-first session): ipc_idle_gap.py again, with the pipe gaps (ping, touch, pack:
# the sender's GPU work just before a call) and per-call host times; run 3 had sleep and spin.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
P=$OUT/${RUN:-run4}
nvidia-smi > $P-nvidia-smi.txt 2>&1
timeout 400 python3 benchmarks/ipc_idle_gap.py --rounds 3 --gaps-us 1000 --out $P-idle-gap.jsonl > $P-idle-gap.log 2>&1; echo "rc=$?" >> $P-idle-gap.log
python3 - $P-idle-gap.jsonl <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if r["case"] == "ipc idle gap":
        print(r["sender"], r["gap"], r["gap_us"], "call", round(r["call_us"]), "copy", round(r["copy_us"]), "host", round(r["host_us"]), "p90", round(r["p90_call_us"]))
PY
tail -3 $P-idle-gap.log
