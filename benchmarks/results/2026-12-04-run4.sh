#!/bin/bash
# Run 4 (sixteenth session): issue 13, where the new-buffer IPC refit's engine side loses against
# the reused buffer's (0.40 against 0.51 x in the twelfth session, though ipc_stages' median call
# was as fast): ipc_stages with each stage's mean and 90th percentile beside its median, then
# refit.py for the ratios of this run.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
P=$OUT/2026-12-04-run4
timeout 150 python3 benchmarks/ipc_stages.py --synced --refits 3 --out $P-ipc-stages.jsonl > $P-ipc-stages.log 2>&1; echo "rc=$?" >> $P-ipc-stages.log
timeout 150 python3 benchmarks/refit.py --bucket-mib 512 --repeats 3 --out $P-refit.jsonl > $P-refit.log 2>&1; echo "rc=$?" >> $P-refit.log
python3 - "$P-ipc-stages.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if r["case"] == "ipc receiver stage":
        print(f'{r["sender"]:10} {r["stage"]:18} n={r["buckets"]:3} med={r["median_ms"]:.3f} mean={r["mean_ms"]:.3f} p90={r["p90_ms"]:.3f} max={r["max_ms"]:.3f}')
PY
grep -v '^{' $P-refit.log | tail -12
