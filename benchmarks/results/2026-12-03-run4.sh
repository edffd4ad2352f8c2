#!/bin/bash
# Run 4 (twelfth session, on the machine run 3 left warm, its wheels installed): run 3's two
# rollouts in the other order (the rule before UNSPLIT_PAIRS_PER_SM first), to see the order's
# effect. Both with the merge tickets of the working tree.
cd .gpu_snap && export PYTHONPATH=/tmp/dormant-site:$PWD PYTHONUNBUFFERED=1
P=$OUT/2026-12-03-run4
timeout 170 python3 benchmarks/rollout.py --multi-steps 4 --unsplit-pairs-per-sm 1000 --out $P-rollout-ms4-before.jsonl > $P-rollout-ms4-before.log 2>&1
timeout 170 python3 benchmarks/rollout.py --multi-steps 4 --out $P-rollout-ms4.jsonl > $P-rollout-ms4.log 2>&1
