#!/bin/bash
# Run 9 (twenty-first session): after run 8 (release_context under MPS failed in the driver's
# lock once the tags slept), an MPS client is refused first by NVML's list of them. Under MPS:
# the new GPU test and residual.py's release case (now "unsupported", with the reason); without:
# the release GPU test (NVML's compute list, now read through the shared query) and the new test
# (it skips).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
P=$OUT/${RUN:-run9}
nvidia-smi > $P-nvidia-smi.txt 2>&1
timeout 150 scripts/with_mps.sh python3 -m pytest -m gpu -q -rs -p no:cacheprovider tests/gpu/test_release_context_mps.py > $P-mps-tests.log 2>&1; echo "mps tests rc=$?"
tail -3 $P-mps-tests.log
timeout 150 scripts/with_mps.sh python3 benchmarks/residual.py --cases release --out $P-residual-mps.jsonl > $P-residual-mps.log 2>&1; echo "mps residual rc=$?"
grep -v '^  ' $P-residual-mps.log | grep -i "unsupported\|error\|release " | cut -c1-400 | tail -4
timeout 200 python3 -m pytest -m gpu -q -rs -p no:cacheprovider tests/gpu/test_residual_release.py tests/gpu/test_release_context_mps.py > $P-plain-tests.log 2>&1; echo "plain tests rc=$?"
tail -4 $P-plain-tests.log
