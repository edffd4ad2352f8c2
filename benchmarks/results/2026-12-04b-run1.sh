#!/bin/bash
# Run 1 (seventeenth session): issue 13, the IPC bucket's copies issued to the driver
# (raw_copies.py: cuMemcpyAsync / cuStreamSynchronize on the raw current stream, the sender's
# event waited on with cuStreamWaitEvent, a reused buffer's view kept): the IPC GPU tests, then
# ipc_stages and refit.py with the driver's copies and with torch's (--torch-copies), alternating.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
P=$OUT/2026-12-04b-run1
timeout 150 python3 -m pytest -m gpu -q -rfEs -p no:cacheprovider tests/gpu/test_raw_copies_gpu.py tests/gpu/test_ipc_release_gpu.py tests/gpu/test_ipc_reuse_gpu.py tests/gpu/test_ipc_refit_gpu.py > $P-tests.log 2>&1; echo "rc=$?" >> $P-tests.log
tail -3 $P-tests.log
for mode in raw torch raw torch; do
  flag=$([ $mode = torch ] && echo --torch-copies)
  timeout 100 python3 benchmarks/ipc_stages.py --synced --refits 3 --modes new,reuse $flag --out $P-ipc-stages.jsonl >> $P-ipc-stages-$mode.log 2>&1; echo "rc=$?" >> $P-ipc-stages-$mode.log
  timeout 120 python3 benchmarks/refit.py --bucket-mib 512 --repeats 3 $flag --out $P-refit.jsonl >> $P-refit-$mode.log 2>&1; echo "rc=$?" >> $P-refit-$mode.log
done
python3 - "$P-ipc-stages.jsonl" <<'PY'
import json, sys
raw = None
for line in open(sys.argv[1]):
    r = json.loads(line)
    if r["case"] == "ipc receiver totals":
        print("totals", r["sender"], "raw" if r["raw_copies"] else "torch")
    if r["case"] == "ipc receiver stage" and r["stage"] in ("read", "copy", "sync", "end payload", "copy on device", "whole call"):
        print(f'{r["sender"]:6} {r["stage"]:15} med={r["median_ms"]:.3f} mean={r["mean_ms"]:.3f} p90={r["p90_ms"]:.3f}')
PY
for mode in raw torch; do echo "== $mode"; grep -v '^{' $P-refit-$mode.log | grep -E "limit|ipc|bf16, one" | cut -c1-40,100-160; done
