#!/bin/bash
# Run 10 (thirteenth session): async scheduling while sequences wait for a slot (d27234c) on the
# GPU: the quick rollout (16 prompts x 256, n=8, 128 out: 128 sequences) at max_num_seqs 32, so
# 96 sequences wait while each batch of 32 decodes; every variant off then on.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/dormant-site .whl/*.whl
export PYTHONPATH=/tmp/dormant-site:$PWD PYTHONUNBUFFERED=1
P=$OUT/2026-12-03-run10
timeout 140 python3 benchmarks/rollout.py --quick --cycles 0 --multi-steps 4 --max-num-seqs 32 \
    --out $P-rollout-quick-32.jsonl > $P-rollout-quick-32.log 2>&1; echo "rc=$?" >> $P-rollout-quick-32.log
grep -v '^{' $P-rollout-quick-32.log | tail -12
