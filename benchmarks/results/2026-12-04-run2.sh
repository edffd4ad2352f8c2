#!/bin/bash
# Run 2 (sixteenth session): issue 18 with run 1's winners as the defaults ("tile-all" experts,
# gate/up one row a program at 2 warps; the PDL GEMV at 4 / 2 rows a program): the engine's
# 48-layer step (moe.py, with the fifteenth session's tiles in a child of the same run), the
# sweep around the new defaults, then the GPU tests of the kernels, the PDL chains and the MoE
# engine lifecycle.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
P=$OUT/2026-12-04-run2
timeout 270 python3 benchmarks/moe.py --layers 48 --skip-kernels --skip-sorted --skip-unfused --skip-plain --skip-knobs-off --skip-peer --out $P-moe48.jsonl > $P-moe48.log 2>&1; echo "rc=$?" >> $P-moe48.log
timeout 150 python3 benchmarks/moe_b1_sweep.py --only moe,layer --budget-s 110 --out $P-moe-b1-sweep.jsonl > $P-moe-b1-sweep.log 2>&1; echo "rc=$?" >> $P-moe-b1-sweep.log
timeout 90 python3 -m pytest -m gpu -q -rfEs -p no:cacheprovider tests/gpu/test_triton_moe.py -k "direct or pdl_chain or gemv" > $P-moe-tests.log 2>&1; echo "rc=$?" >> $P-moe-tests.log
timeout 120 python3 -m pytest -m gpu -q -rfEs -p no:cacheprovider tests/gpu/test_pdl_layer_chain.py tests/gpu/test_moe_lifecycle.py > $P-gpu-tests.log 2>&1; echo "rc=$?" >> $P-gpu-tests.log
grep -v '^{' $P-moe48.log | tail -22
grep -v '^{' $P-moe-b1-sweep.log | tail -25
tail -3 $P-moe-tests.log; tail -8 $P-gpu-tests.log
