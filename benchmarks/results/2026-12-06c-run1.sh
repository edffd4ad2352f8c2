#!/bin/bash
# Run 1 (twenty-first session): tp_scenario.py's same_cache version (never run on a GPU), then the
# twentieth session's pending script (the overlap probe with SM carveouts at batch 512 and 256, with
# the typed-streams fix; refit.py at 512 MiB twice).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
P=$OUT/${RUN:-run1}
nvidia-smi > $P-nvidia-smi.txt 2>&1
timeout 150 python3 benchmarks/tp_scenario.py --tp 1 --layers 4 --cycles 2 --out $P-tp-scenario.jsonl > $P-tp-scenario.log 2>&1; echo "rc=$?" >> $P-tp-scenario.log
grep -v '^{' $P-tp-scenario.log | tail -20
RUN=run1 bash benchmarks/results/2026-12-06b-pending.sh
