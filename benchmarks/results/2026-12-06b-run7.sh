#!/bin/bash
# Run 7 (twentieth session): tp_scenario.py's cold_equal (does a generate on an empty prefix
# cache equal the reference made on a warm one, in bf16 on the GPU?), then the pending script
# (the overlap probe with SM carveouts at batch 512 and 256, refit.py at 512 MiB twice).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
P=$OUT/${RUN:-run7}
nvidia-smi > $P-nvidia-smi.txt 2>&1
timeout 150 python3 benchmarks/tp_scenario.py --tp 1 --layers 4 --cycles 1 --out $P-tp-scenario.jsonl > $P-tp-scenario.log 2>&1; echo "rc=$?" >> $P-tp-scenario.log
grep -v '^{' $P-tp-scenario.log; grep -h '"control"' $P-tp-scenario.jsonl
RUN=run7 bash benchmarks/results/2026-12-06b-pending.sh
