#!/bin/bash
# Run 3 (twenty-fourth session): run 2's script again at 8920ac6 (AsyncLLM's waiting ids,
# unfinished counts, FINAL_ONLY abort outputs, get_metrics). Not run: no machine came.
RUN=${RUN:-run3} exec bash "$(dirname "$0")/2026-12-07-run2.sh"
