#!/bin/bash
# Run 5 (sixteenth session): issue 13, the IPC bucket's copy on the SMs (byte_copy.py: one
# bitwise_or kernel) against cudaMemcpyAsync (run 4: enqueueing the one merged copy took
# 0.09-0.12 ms of the host's 0.28 ms a bucket): the byte-copy GPU tests, then ipc_stages and
# refit.py each way, alternating.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
P=$OUT/2026-12-04-run5
timeout 60 python3 -m pytest -m gpu -q -rfEs -p no:cacheprovider tests/gpu/test_byte_copy_gpu.py > $P-tests.log 2>&1; echo "rc=$?" >> $P-tests.log
for mode in sm ce; do
  flag=$([ $mode = sm ] && echo --sm-copies)
  timeout 100 python3 benchmarks/ipc_stages.py --synced --refits 3 $flag --out $P-ipc-stages.jsonl > $P-ipc-stages-$mode.log 2>&1; echo "rc=$?" >> $P-ipc-stages-$mode.log
  timeout 120 python3 benchmarks/refit.py --bucket-mib 512 --repeats 3 $flag --out $P-refit.jsonl > $P-refit-$mode.log 2>&1; echo "rc=$?" >> $P-refit-$mode.log
done
tail -3 $P-tests.log
python3 - "$P-ipc-stages.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if r["case"] == "ipc receiver stage" and r["stage"] in ("copy", "sync", "copy on device", "whole call"):
        print(f'sm={r["sm_copies"]!s:5} {r["sender"]:10} {r["stage"]:15} med={r["median_ms"]:.3f} mean={r["mean_ms"]:.3f} p90={r["p90_ms"]:.3f}')
PY
for mode in sm ce; do grep -v '^{' $P-refit-$mode.log | tail -11 | cut -c1-40,100-160; done
