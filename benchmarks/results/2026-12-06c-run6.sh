#!/bin/bash
# Run 6 (twenty-first session): scripts/gpu_suite.sh's new "mps" stage, as it stood at this call:
# refit.py without and with MPS (scripts/with_mps.sh), alternating twice; ipc_idle_gap.py under MPS
# only (the stage now runs it without MPS too; run 7 did that on the same machine); the memory,
# IPC and engine-graph GPU tests and the demo under MPS. The stage packs its files in one archive;
# they are unpacked here as 2026-12-06c-run6-<file>.
OUT=$OUT/mps timeout 560 bash scripts/gpu_suite.sh mps
