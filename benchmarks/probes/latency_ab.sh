#!/usr/bin/env bash
# Idle-worker latency of two revisions, interleaved: latency.sh from a worktree of each,
# alternating, ROUNDS rounds of N tasks; prints each run's p50/p95/p99 and the load
# (through ab.sh, which keeps the worktrees and the alternation).
#   bash benchmarks/probes/latency_ab.sh BEFORE AFTER [ROUNDS] [N]
# e.g. bash benchmarks/probes/latency_ab.sh 4a685c1 HEAD 6 300
set -euo pipefail
before=$1 after=$2 rounds=${3:-6} n=${4:-300}
# each side's schema and trace file are its own: named after the worktree it runs in
bash "$(dirname "$0")/ab.sh" "$before" "$after" "$rounds" bash -c '
    side=$(basename "$PWD")
    cd benchmarks/probes &&
    PROBE_SCHEMA="probe_lat_$side" PROBE_TRACE="$PWD/../../../$side.trace" \
        bash latency.sh "$1" 2>/dev/null | grep "^latency"' _ "$n" | grep -E "^(==|r[0-9]+ )"
