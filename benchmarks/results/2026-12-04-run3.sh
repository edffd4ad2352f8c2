#!/bin/bash
# Run 3 (sixteenth session): issue 18 with "tile-all"'s down kernel at one column a program (run 2:
# -0.2 / -0.8 us a layer in the moe / layer chains): the engine's 48-layer step with the kernel
# sweeps (the experts alone at batch 1-64: "tile-all" against the fifteenth session's "tile"), the
# fifteenth session's tiles in a child of the same run, then the MoE GPU tests again.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
P=$OUT/2026-12-04-run3
timeout 330 python3 benchmarks/moe.py --layers 48 --skip-sorted --skip-unfused --skip-plain --skip-knobs-off --skip-peer --out $P-moe48.jsonl > $P-moe48.log 2>&1; echo "rc=$?" >> $P-moe48.log
timeout 95 python3 -m pytest -m gpu -q -rfEs -p no:cacheprovider tests/gpu/test_triton_moe.py -k "direct or pdl_chain or gemv" > $P-moe-tests.log 2>&1; echo "rc=$?" >> $P-moe-tests.log
timeout 110 python3 -m pytest -m gpu -q -rfEs -p no:cacheprovider tests/gpu/test_pdl_layer_chain.py tests/gpu/test_moe_lifecycle.py > $P-gpu-tests.log 2>&1; echo "rc=$?" >> $P-gpu-tests.log
grep -v '^{' $P-moe48.log | grep -v "^  " | tail -40
tail -3 $P-moe-tests.log; tail -4 $P-gpu-tests.log
