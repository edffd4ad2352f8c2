#!/bin/bash
# (Ran as run 1 of 2026-12-05. Its --max-run-mib flag was removed afterwards, with the pieces it set:
# this file records what ran and no longer runs as it stands.)
# Pending (seventeenth session; its run 2 lost the machine before it started, and no other was
# lent): issue 13. Run 1 found the driver's cuMemcpyAsync no cheaper to
# enqueue than torch's copy_ (about 0.09 ms for the 512 MiB bucket), so the cost is the driver's:
# copy_enqueue.py times the enqueue by size and end of either copy (torch, the weights pool, IPC),
# and whether copies in pieces let the device start sooner; then refit.py with the plan's byte
# runs in pieces of at most 128 / 32 MiB against one copy a run, alternating, and ipc_stages at 128.
# First the IPC release GPU tests, with pieces of 4 KiB too (test_bucket_copies_in_pieces_arrive).
# Issue 16: overlap_probe.py, whether two half-batches on two streams overlap the batch-512
# step's GEMMs with its attention.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
P=$OUT/${RUN:-pending}
timeout 120 python3 -m pytest -m gpu -q -rfEs -p no:cacheprovider tests/gpu/test_ipc_release_gpu.py > $P-tests.log 2>&1; echo "rc=$?" >> $P-tests.log
tail -3 $P-tests.log
timeout 90 python3 benchmarks/copy_enqueue.py --out $P-copy-enqueue.jsonl > $P-copy-enqueue.log 2>&1; echo "rc=$?" >> $P-copy-enqueue.log
timeout 150 python3 benchmarks/overlap_probe.py --out $P-overlap.jsonl > $P-overlap.log 2>&1; echo "rc=$?" >> $P-overlap.log
for mib in 0 128 32 0 128 32; do
  timeout 100 python3 benchmarks/refit.py --bucket-mib 512 --repeats 3 --max-run-mib $mib --out $P-refit.jsonl >> $P-refit-$mib.log 2>&1; echo "rc=$?" >> $P-refit-$mib.log
done
timeout 100 python3 benchmarks/ipc_stages.py --synced --refits 3 --modes new,reuse --max-run-mib 128 --out $P-ipc-stages.jsonl > $P-ipc-stages.log 2>&1; echo "rc=$?" >> $P-ipc-stages.log
python3 - "$P-copy-enqueue.jsonl" "$P-ipc-stages.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if r["case"] == "enqueue":
        print(f'enqueue {r["copy"]:15} {r["mib"]:4} MiB host {r["host_us"]:8.1f} us')
    elif r["case"] == "chunked":
        print(f'chunked {r["copy"]:15} {r["chunks"]:2} pieces until done {r["until_done_us"]:8.1f} us')
for line in open(sys.argv[2]):
    r = json.loads(line)
    if r["case"] == "ipc receiver stage" and r["stage"] in ("read", "copy", "sync", "copy on device", "whole call"):
        print(f'{r["sender"]:6} {r["stage"]:15} med={r["median_ms"]:.3f} mean={r["mean_ms"]:.3f} p90={r["p90_ms"]:.3f}')
PY
for mib in 0 128 32; do echo "== $mib"; grep -E "^ipc buckets of 512 MiB, (a new|one reused)|^limit" $P-refit-$mib.log | cut -c1-40,100-160; done
tail -3 $P-copy-enqueue.log
grep -v '^{' $P-overlap.log | tail -12
