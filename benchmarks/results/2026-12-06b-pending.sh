#!/bin/bash
# What the twentieth session could only run on H100s, for `scripts/gpu_suite.sh pending` on an
# H200 (~5 min; on an H100 it repeats 2026-12-06b runs 2-3):
# - issue 16: overlap_probe.py at batch 512 and 256 with the GEMMs held to fewer SMs. On the H100
#   two half-batches cost a second read of the weights (+0.115 ms a layer: its batch-256 GEMMs are
#   bound by memory), so no two-stream way beat the whole batch (1.07-1.12 x). The H200's
#   batch-256 GEMMs are compute-bound (ridge ~206 FLOP/byte): if a two-stream way beats "one
#   batch" there, a two-batch overlap step could take the caching-off step under 1.4 x.
# - issue 13: refit.py at 512 MiB with this receiver (the stream lookup, the cheaper awake check),
#   twice: the H200's engine side was 0.40-0.52 with the nineteenth session's.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
P=$OUT/${RUN:-pending}
timeout 300 python3 benchmarks/overlap_probe.py --batch-sizes 512,256 --carveouts 16,32,48 --out $P-overlap.jsonl > $P-overlap.log 2>&1; echo "rc=$?" >> $P-overlap.log
grep -v '^{' $P-overlap.log | tail -36
for round in 1 2; do
  timeout 100 python3 benchmarks/refit.py --bucket-mib 512 --repeats 3 --modes new,reuse --out $P-refit.jsonl >> $P-refit.log 2>&1; echo "rc=$? round $round" >> $P-refit.log
done
grep rc= $P-refit.log
python3 - $P-refit.jsonl <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if r["case"].startswith("ipc buckets"):
        print(r["case"][23:45], "engine", round(r["engine_of_limit"], 3), "verified", r["verified"])
PY
