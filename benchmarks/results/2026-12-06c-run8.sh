#!/bin/bash
# Run 8 (twenty-first session): what a level-2 sleep leaves on the device without and with MPS
# (residual.py, cases multi and release): runs 5-7 recommend MPS for colocated refits, and the
# residual under it was not measured; release_context=True (the checkpoint helper) under MPS is
# the open question.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
P=$OUT/${RUN:-run8}
nvidia-smi > $P-nvidia-smi.txt 2>&1
timeout 240 python3 benchmarks/residual.py --cases multi release --out $P-residual-plain.jsonl > $P-residual-plain.log 2>&1; echo "plain rc=$?"
timeout 240 scripts/with_mps.sh python3 benchmarks/residual.py --cases multi release --out $P-residual-mps.jsonl > $P-residual-mps.log 2>&1; echo "mps rc=$?"
for way in plain mps; do echo "== $way"; grep -v '^{' $P-residual-$way.log | tail -15; done
