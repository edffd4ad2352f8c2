#!/usr/bin/env bash
# The mixture-of-experts GPU run (issue 18), one command on a CUDA machine, about 7 minutes:
# the MoE GPU tests (Triton kernels against the torch reference, the lifecycle matrix, HF
# equality on the GPU), benchmarks/moe.py (Qwen3-30B-A3B dimensions, peer included) and
# `dormant demo --model-family moe`. Logs and raw JSON go to $OUT (default ./out).
#
#   scripts/gpu_moe.sh [extra arguments for benchmarks/moe.py, e.g. --layers 8]
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
status=0
nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1
python3 -m pytest -m gpu -q -rs -p no:cacheprovider -k moe tests/gpu/test_triton_moe.py \
  tests/gpu/test_moe_lifecycle.py tests/models/test_hf_equality.py 2>&1 | tee "$OUT/moe-tests.log"
status=$((status | PIPESTATUS[0]))
python3 benchmarks/moe.py --out "$OUT/moe.jsonl" "$@" 2>&1 | tee "$OUT/moe.log"
status=$((status | PIPESTATUS[0]))
python3 -m dormant.cli demo --model-family moe --png "$OUT/demo-moe-timeline.png" 2>&1 \
  | tee "$OUT/demo-moe.log"
status=$((status | PIPESTATUS[0]))
exit $status
