#!/bin/bash
# Run 1 (sixteenth session): issue 18, two new batch-1 choices: the "tile-all" experts (gate/up
# in whole-depth tiles, as the tile down kernel) and the PDL GEMV's narrow whole-depth tiles.
# The sweep of the moe and layer chains first, then the MoE kernels' GPU tests with the new cases.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
P=$OUT/2026-12-04-run1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,power.draw --format=csv > $P-nvidia-smi.txt
timeout 330 python3 benchmarks/moe_b1_sweep.py --only moe,layer --budget-s 270 --out $P-moe-b1-sweep.jsonl > $P-moe-b1-sweep.log 2>&1; echo "rc=$?" >> $P-moe-b1-sweep.log
timeout 200 python3 -m pytest -m gpu -q -rfEs -p no:cacheprovider tests/gpu/test_triton_moe.py -k "direct or pdl_chain or gemv" > $P-moe-tests.log 2>&1; echo "rc=$?" >> $P-moe-tests.log
grep -v '^{' $P-moe-b1-sweep.log | tail -45
tail -6 $P-moe-tests.log
