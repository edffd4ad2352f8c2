#!/bin/bash
# Run 6 (sixteenth session): issue 18 after af66942 (the two gate/up kernels share their prologue
# and epilogue: the same code, inlined): the MoE kernels' GPU tests, the PDL layer chains and the
# MoE lifecycle again, then the engine's 48-layer step at the final code (no child runs).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
P=$OUT/2026-12-04-run6
timeout 110 python3 -m pytest -m gpu -q -rfEs -p no:cacheprovider tests/gpu/test_triton_moe.py -k "direct or pdl_chain or gemv" > $P-moe-tests.log 2>&1; echo "rc=$?" >> $P-moe-tests.log
timeout 110 python3 -m pytest -m gpu -q -rfEs -p no:cacheprovider tests/gpu/test_pdl_layer_chain.py tests/gpu/test_moe_lifecycle.py > $P-gpu-tests.log 2>&1; echo "rc=$?" >> $P-gpu-tests.log
timeout 200 python3 benchmarks/moe.py --layers 48 --skip-kernels --skip-sorted --skip-unfused --skip-plain --skip-knobs-off --skip-fifteenth --skip-peer --out $P-moe48.jsonl > $P-moe48.log 2>&1; echo "rc=$?" >> $P-moe48.log
tail -3 $P-moe-tests.log; tail -3 $P-gpu-tests.log
grep -v '^{' $P-moe48.log | grep -v "^  " | tail -12
