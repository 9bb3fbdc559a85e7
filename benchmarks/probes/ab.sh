#!/usr/bin/env bash
# Any command run from a worktree of each of two revisions, interleaved, ROUNDS rounds:
# each run's output lines are prefixed with its round, its side and the load before it.
#   bash benchmarks/probes/ab.sh BEFORE AFTER ROUNDS COMMAND...
# e.g. the held-snapshot scenario before and after the storage change (issue 30):
#   bash benchmarks/probes/ab.sh c51ce87 HEAD 1 python -m benchmarks.chaos snapshot --minutes 2 --hold dump
# or the harness beside RabbitMQ:
#   bash benchmarks/probes/ab.sh c51ce87 HEAD 2 python -m benchmarks --quick --runs 1 \
#       --only kombu,celery_publish,drain,latency --brokers pgqueue,rabbitmq
set -euo pipefail
before=$1 after=$2 rounds=$3
shift 3
repo=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
work=$(mktemp -d)
trap 'git -C "$repo" worktree remove --force "$work/before" 2>/dev/null || true;
      git -C "$repo" worktree remove --force "$work/after" 2>/dev/null || true; rm -rf "$work"' EXIT
git -C "$repo" worktree add -q --detach "$work/before" "$before"
git -C "$repo" worktree add -q --detach "$work/after" "$after"
for round in $(seq 1 "$rounds"); do
    for side in before after; do
        load=$(cut -d' ' -f1-3 /proc/loadavg)
        echo "== round $round $side ($(git -C "$work/$side" rev-parse --short HEAD)), load $load"
        (cd "$work/$side" && PYTHONPATH="$work/$side" "$@" 2>&1) | sed "s/^/r$round $side | /" || true
    done
done
