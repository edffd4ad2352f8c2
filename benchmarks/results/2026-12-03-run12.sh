#!/bin/bash
# Run 12 (fifteenth session): #16 after the group admission (531cb4a: a leader counts its
# waiting siblings against max_num_seqs): the rollout at max_num_seqs 64 with two RL cycles,
# the device's decode-step time before/after each, and the GPU's clocks beside it; first the
# fork and prefix-cache GPU tests.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/dormant-site .whl/*.whl
export PYTHONPATH=/tmp/dormant-site:$PWD PYTHONUNBUFFERED=1
P=$OUT/2026-12-03-run12
timeout 120 python3 -m pytest -m gpu -q -rfEs -p no:cacheprovider tests/gpu/test_fork_gpu.py \
    tests/gpu/test_prefix_cache_gpu.py > $P-gpu-tests.log 2>&1; echo "rc=$?" >> $P-gpu-tests.log
tail -4 $P-gpu-tests.log
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active \
    --format=csv,nounits -lms 500 > $P-clocks.csv 2>&1 &
SMI=$!
timeout 420 python3 benchmarks/rollout.py --multi-steps 4 --max-num-seqs 64 --async-scheduling on --cycles 2 --out $P-rollout-64.jsonl > $P-rollout-64.log 2>&1; echo "rc=$?" >> $P-rollout-64.log
kill $SMI
grep -v '^{' $P-rollout-64.log | tail -10
