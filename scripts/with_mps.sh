#!/bin/bash
# Runs a command with its CUDA processes sharing one GPU context through a private MPS control
# daemon (its own pipe and log folders, so no other process on the machine is moved under it),
# then quits the daemon. The GPU's compute mode and settings are not changed.
#
# Why (issue 13, RESULTS.md 2026-12-06, twenty-first session): a trainer and an engine colocated
# on one GPU are two CUDA contexts, and without MPS the GPU switches between them at every handoff:
# each refit bucket's copy started ~150 us late on an H100 when the trainer's process had just
# packed it, against 33-54 us of the receiver's own host work per bucket.
#
#   scripts/with_mps.sh python3 benchmarks/refit.py --modes new,reuse
set -uo pipefail
control=$(command -v nvidia-cuda-mps-control) || {
  echo "with_mps: nvidia-cuda-mps-control is not on this machine" >&2
  exit 3
}
dir=$(mktemp -d /tmp/dormant-mps.XXXXXX)
trap 'rm -rf "$dir"' EXIT
export CUDA_MPS_PIPE_DIRECTORY=$dir/pipe CUDA_MPS_LOG_DIRECTORY=$dir/log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
"$control" -d || exit 3
trap 'echo quit | "$control"; rm -rf "$dir"' EXIT
# The command runs as a child this shell waits for, so that a TERM, INT, HUP or QUIT sent to the
# shell (by `timeout`, say) reaches it too, and the daemon is still told to quit once it exited.
"$@" <&0 &
child=$!
trap 'kill -TERM "$child" 2>/dev/null' TERM INT HUP QUIT
wait "$child"
status=$?
while kill -0 "$child" 2>/dev/null; do  # the wait was cut short by a signal: wait for the exit
  wait "$child"
  status=$?
done
log=$CUDA_MPS_LOG_DIRECTORY/control.log
echo "with_mps: exit status $status; MPS servers started: $(grep -c "Starting new server" "$log");" \
  "clients: $(grep -c "NEW CLIENT" "$log")" >&2
exit $status
