#!/usr/bin/env bash
# Idle-worker latency of two revisions, interleaved: latency.sh from a worktree of each,
# alternating, ROUNDS rounds of N tasks; prints each run's p50/p95/p99 and the load.
#   bash benchmarks/probes/latency_ab.sh BEFORE AFTER [ROUNDS] [N]
# e.g. bash benchmarks/probes/latency_ab.sh 4a685c1 HEAD 6 300
set -euo pipefail
before=$1 after=$2 rounds=${3:-6} n=${4:-300}
repo=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
work=$(mktemp -d)
trap 'git -C "$repo" worktree remove --force "$work/before" 2>/dev/null || true;
      git -C "$repo" worktree remove --force "$work/after" 2>/dev/null || true; rm -rf "$work"' EXIT
git -C "$repo" worktree add -q --detach "$work/before" "$before"
git -C "$repo" worktree add -q --detach "$work/after" "$after"
for round in $(seq 1 "$rounds"); do
    for side in before after; do
        load=$(cut -d' ' -f1-3 /proc/loadavg)
        line=$(cd "$work/$side/benchmarks/probes" &&
            PYTHONPATH="$work/$side" PROBE_SCHEMA="probe_lat_$side" \
            PROBE_TRACE="$work/$side.trace" bash latency.sh "$n" 2>/dev/null | grep '^latency')
        echo "round $round $side: $line | load $load"
    done
done
