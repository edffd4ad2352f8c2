#!/bin/bash
# Run 13 (fifteenth session): #16, the rollout's default (all 512 sequences at once,
# --multi-steps 4, async scheduling off then on) at HEAD, after the group admission (531cb4a),
# which must change nothing when max_num_seqs is not binding.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/dormant-site .whl/*.whl
export PYTHONPATH=/tmp/dormant-site:$PWD PYTHONUNBUFFERED=1
P=$OUT/2026-12-03-run13
timeout 480 python3 benchmarks/rollout.py --multi-steps 4 --out $P-rollout-ms4.jsonl > $P-rollout-ms4.log 2>&1; echo "rc=$?" >> $P-rollout-ms4.log
grep -v '^{' $P-rollout-ms4.log | tail -14
