#!/bin/bash
# Run 3 (twentieth session), ~5 min on one GPU.
# - issue 16: overlap_probe.py at batch 512 with the GEMMs held to fewer SMs (cuBLASLt's SM count
#   target) and the lockstep halves on typed streams (feed-forward high priority, attention low):
#   can the compute-bound GEMMs and the bandwidth-bound attention run at once after all?
# - issue 20: tp_scenario.py at TP=1 with the arena placed best fit (e301dd1): run 2's level-1
#   sleep spent 1.97 s growing the arena after a level-2 sleep took the weights chunk's room.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
P=$OUT/${RUN:-run3}
nvidia-smi > $P-nvidia-smi.txt 2>&1
timeout 300 python3 benchmarks/overlap_probe.py --batch-sizes 512 --carveouts 16,32,48 --out $P-overlap.jsonl > $P-overlap.log 2>&1; echo "rc=$?" >> $P-overlap.log
grep -v '^{' $P-overlap.log | tail -25
timeout 150 python3 benchmarks/tp_scenario.py --tp 1 --layers 4 --cycles 3 --out $P-tp-scenario.jsonl > $P-tp-scenario.log 2>&1; echo "rc=$?" >> $P-tp-scenario.log
grep -v '^{' $P-tp-scenario.log; grep -h '"control"' $P-tp-scenario.jsonl
grep -h '"rank"' $P-tp-scenario.jsonl | python3 -c "
import json, sys
for line in sys.stdin:
    r = json.loads(line)
    print(r['cycle'], r['level'], {k: r.get(k) for k in ('sleep_s', 'sleep_arena_s', 'sleep_copy_s', 'sleep_bytes_copied', 'residual_bytes')})"
