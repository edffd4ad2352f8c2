#!/bin/bash
# Run 2 (twenty-second session, an H100: no H200 started twice): the whole GPU test suite at
# main as a regression check (the last full run was 2026-12-04's), with the self-launching MPS
# refusal test in it.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
P=$OUT/${RUN:-run2}
nvidia-smi > $P-nvidia-smi.txt 2>&1
python3 -c "import fastapi, uvicorn, openai, schemathesis" 2>/dev/null || skip=--ignore=tests/server
timeout 560 python3 -m pytest -m gpu -q -rs -p no:cacheprovider --durations=15 ${skip:-} tests > $P-gpu-tests.log 2>&1
echo "rc=$?" >> $P-gpu-tests.log
grep -v "^\.*s*\.*\s*\[" $P-gpu-tests.log | tail -40
