#!/bin/bash
# Run 8 (thirteenth session): #16 the rollout again with async scheduling on first, then off, per
# variant (run 7 ran off first), and the GPU's clocks and power sampled every 200 ms beside it:
# run 7's device times per call were 2-3 % longer with async on; a GPU that never idles may
# clock lower.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/dormant-site .whl/*.whl
export PYTHONPATH=/tmp/dormant-site:$PWD PYTHONUNBUFFERED=1
P=$OUT/2026-12-03-run8
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active \
    --format=csv,nounits -lms 200 > $P-clocks.csv 2>&1 &
SMI=$!
python3 -c "import time; print('epoch_at_start', time.time())" > $P-epoch.txt
timeout 330 python3 benchmarks/rollout.py --multi-steps 4 --async-scheduling on,off --out $P-rollout-ms4.jsonl > $P-rollout-ms4.log 2>&1; echo "rc=$?" >> $P-rollout-ms4.log
kill $SMI
python3 -c "import time; print('epoch_at_end', time.time())" >> $P-epoch.txt
date -u +%Y/%m/%d\ %H:%M:%S.000 >> $P-epoch.txt
grep -v '^{' $P-rollout-ms4.log | tail -14
