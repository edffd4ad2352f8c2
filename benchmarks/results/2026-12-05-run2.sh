#!/bin/bash
# Run 2 (eighteenth session). Issue 13: the IPC GPU tests after the byte-run pieces were taken
# out (run 1: no gain), and how the receiver's time beyond the copy scales with the bucket's
# size: refit.py and ipc_stages.py at 1 and 2 GiB buckets (512 MiB in run 1). Issue 16: the
# overlap probe again, on whichever card this call got (run 1's was an H100).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
P=$OUT/${RUN:-2026-12-05-run2}
timeout 150 python3 -m pytest -m gpu -q -rfEs -p no:cacheprovider tests/gpu/test_ipc_release_gpu.py tests/gpu/test_ipc_reuse_gpu.py tests/gpu/test_ipc_refit_gpu.py > $P-tests.log 2>&1; echo "rc=$?" >> $P-tests.log
tail -3 $P-tests.log
timeout 150 python3 benchmarks/overlap_probe.py --out $P-overlap.jsonl > $P-overlap.log 2>&1; echo "rc=$?" >> $P-overlap.log
for mib in 512 1024 2048; do
  timeout 100 python3 benchmarks/refit.py --bucket-mib $mib --repeats 3 --out $P-refit.jsonl > $P-refit-$mib.log 2>&1; echo "rc=$?" >> $P-refit-$mib.log
  timeout 100 python3 benchmarks/ipc_stages.py --bucket-mib $mib --synced --refits 3 --modes new,reuse --out $P-ipc-stages.jsonl > $P-ipc-stages-$mib.log 2>&1; echo "rc=$?" >> $P-ipc-stages-$mib.log
done
python3 - "$P-ipc-stages.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if r["case"] == "ipc receiver stage" and r["stage"] in ("read", "copy", "sync", "copy on device", "whole call"):
        print(f'{r["bucket_mib"]:5} {r["sender"]:6} {r["stage"]:15} med={r["median_ms"]:.3f} mean={r["mean_ms"]:.3f} p90={r["p90_ms"]:.3f}')
PY
for mib in 512 1024 2048; do echo "== $mib"; grep -E "^ipc buckets of [0-9]+ MiB, (a new|one reused)|^limit|^bf16, one" $P-refit-$mib.log | cut -c1-40,100-160; done
grep -v '^{' $P-overlap.log | tail -10
