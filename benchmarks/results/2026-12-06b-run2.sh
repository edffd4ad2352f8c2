#!/bin/bash
# Run 2 (twentieth session), ~6 min on one GPU.
# - issue 20: tp_scenario.py at TP=1 with its reference made from the cache state a cycle leaves
#   and a control reference (run 1 found every cycle's tokens unlike a first generate made on an
#   empty prefix cache), and each rank's sleep parts (run 1's level-1 sleep took 2.18 s);
# - issue 13: the IPC receiver with one C call for the current stream (cuda_streams.py) against
#   the committed one (.ab/base: `git archive HEAD~1 dormant benchmarks`, with this tree's
#   refit.py copied in), in turn, twice, at 512 MiB; and the new receiver with the engine side
#   polling for its buckets (--spin: does the host's wake from a blocking read cost the receive?).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
P=$OUT/${RUN:-run2}
nvidia-smi > $P-nvidia-smi.txt 2>&1
timeout 150 python3 -m pytest -m gpu -q -rfEs -p no:cacheprovider tests/gpu/test_cuda_streams_gpu.py tests/gpu/test_ipc_release_gpu.py > $P-tests.log 2>&1; echo "rc=$?" >> $P-tests.log
tail -2 $P-tests.log
timeout 150 python3 benchmarks/tp_scenario.py --tp 1 --layers 4 --cycles 3 --out $P-tp-scenario.jsonl > $P-tp-scenario.log 2>&1; echo "rc=$?" >> $P-tp-scenario.log
grep -v '^{' $P-tp-scenario.log; grep -h '"control"' $P-tp-scenario.jsonl
grep -h '"rank"' $P-tp-scenario.jsonl | python3 -c "
import json, sys
for line in sys.stdin:
    r = json.loads(line)
    print(r['cycle'], r['level'], {k: r.get(k) for k in ('sleep_s', 'sleep_arena_s', 'sleep_hash_s', 'sleep_copy_s', 'sleep_bytes_copied')})"
for variant in base new spin base new spin; do
  tree=.; extra=
  [[ $variant == base ]] && tree=.ab/base
  [[ $variant == spin ]] && extra=--spin
  timeout 100 python3 $tree/benchmarks/refit.py --bucket-mib 512 --repeats 3 --modes new,reuse $extra --out $P-refit-$variant.jsonl >> $P-refit.log 2>&1; echo "rc=$? $variant" >> $P-refit.log
done
grep rc= $P-refit.log
python3 - $P-refit-base.jsonl $P-refit-new.jsonl $P-refit-spin.jsonl <<'PY'
import json, sys
for path in sys.argv[1:]:
    for line in open(path):
        r = json.loads(line)
        if r["case"].startswith("limit"):
            print(path.split("-")[-1][:-6], "limit", round(r["seconds"] * 1e3, 3), "ms")
        if r["case"].startswith("ipc buckets"):
            print(path.split("-")[-1][:-6], r["case"][23:45], "engine", round(r["engine_of_limit"], 3), "end to end", round(r["of_limit"], 3), "verified", r["verified"])
PY
