#!/bin/bash
# Run 2 (nineteenth session). Issue 13: where the IPC read's host time goes on this host
# (ipc_stages.py --read-parts), each CUDA call's host time with a VMM destination too
# (ipc_primitives.py), the host's speed on the CPU-only receive (ipc_host.py, fixed to
# build its engine on the CPU), and the committed tree (.ab/base) against the working tree (the
# framed head, no slice of a whole bucket, no no_grad around byte runs): refit.py at 512 MiB,
# in turn. .ab/base was `git archive cebc91e dormant benchmarks` (the session's starting
# commit), carried.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
P=$OUT/${RUN:-2026-12-06-run2}
nvidia-smi > $P-nvidia-smi.txt 2>&1
timeout 100 python3 benchmarks/ipc_stages.py --bucket-mib 512 --synced --refits 3 --modes reuse,new --read-parts --out $P-read-parts.jsonl > $P-read-parts.log 2>&1; echo "rc=$?" >> $P-read-parts.log
timeout 100 python3 benchmarks/ipc_primitives.py --out $P-primitives.jsonl > $P-primitives.log 2>&1; echo "rc=$?" >> $P-primitives.log
timeout 100 python3 benchmarks/ipc_host.py --refits 10 --out $P-ipc-host.jsonl > $P-ipc-host.log 2>&1; echo "rc=$?" >> $P-ipc-host.log
for tree in .ab/base . .ab/base .; do
  name=$([[ $tree == . ]] && echo new || echo base)
  timeout 90 python3 $tree/benchmarks/refit.py --bucket-mib 512 --repeats 3 --out $P-refit-$name.jsonl >> $P-refit.log 2>&1; echo "rc=$? $name" >> $P-refit.log
done
grep rc= $P-*.log
grep -v -E '^\{|Producer process' $P-primitives.log
python3 - $P <<'PY'
import json, sys
P = sys.argv[1]
for line in open(f"{P}-read-parts.jsonl"):
    r = json.loads(line)
    if r["case"] == "ipc receiver stage":
        print(f'parts {r["sender"]:6} {r["stage"]:18} med={r["median_ms"]*1e3:7.1f} us  mean={r["mean_ms"]*1e3:7.1f}')
for line in open(f"{P}-ipc-host.jsonl"):
    r = json.loads(line)
    if r["case"] == "ipc host stage":
        print(f'cpu path {r["stage"]:24} med={r["median_us"]:7.1f} us')
for name in ("base", "new"):
    for line in open(f"{P}-refit-{name}.jsonl"):
        r = json.loads(line)
        if r["case"].startswith(("ipc buckets of 512 MiB, a new", "ipc buckets of 512 MiB, one reused")):
            print(name, r["case"][23:45], "engine", round(r["engine_of_limit"], 3), "end to end", round(r["of_limit"], 3))
PY
tar -C "$OUT" -czf /tmp/run2.tgz . && find "$OUT" -mindepth 1 -delete && mv /tmp/run2.tgz "$OUT/"
