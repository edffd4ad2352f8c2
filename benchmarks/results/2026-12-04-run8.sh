#!/bin/bash
# Run 8 (sixteenth session): the MoE kernels' GPU tests after the review's test change: the
# reference-match cases take "direct" (KERNELS, "tile-all"), "direct-loop" and "direct-tile"
# (the fifteenth session's kernels), where "direct-tile-all" had repeated "direct".
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
P=$OUT/2026-12-04-run8
timeout 150 python3 -m pytest -m gpu -q -rfEs -p no:cacheprovider tests/gpu/test_triton_moe.py -k "direct or pdl_chain" > $P-moe-tests.log 2>&1; echo "rc=$?" >> $P-moe-tests.log
tail -4 $P-moe-tests.log
