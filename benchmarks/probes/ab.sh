#!/usr/bin/env bash
# Any command run from a worktree of each of two (or more) revisions, interleaved, ROUNDS
# rounds: each run's output lines are prefixed with its round, its side and the load
# before it.
#   bash benchmarks/probes/ab.sh BEFORE AFTER ROUNDS COMMAND...
# BEFORE may name several revisions, comma-separated (sides before1, before2, ...), all
# run in each round before AFTER. E.g. the held-snapshot scenario before and after the
# storage change (issue 30):
#   bash benchmarks/probes/ab.sh c51ce87 HEAD 1 python -m benchmarks.chaos snapshot --minutes 2 --hold dump
# or the harness beside RabbitMQ, main before both issues, before the re-cut, and now:
#   bash benchmarks/probes/ab.sh c51ce87,dd341a8 HEAD 3 python -m benchmarks --quick --runs 1 \
#       --only kombu,celery_publish,drain,latency --brokers pgqueue,rabbitmq
set -euo pipefail
befores=$1 after=$2 rounds=$3
shift 3
repo=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
work=$(mktemp -d)
IFS=',' read -r -a revs <<< "$befores"
if [ "${#revs[@]}" -eq 1 ]; then
    sides=(before)
else
    sides=()
    for i in "${!revs[@]}"; do sides+=("before$((i + 1))"); done
fi
revs+=("$after")
sides+=(after)
trap 'for s in "${sides[@]}"; do git -C "$repo" worktree remove --force "$work/$s" 2>/dev/null || true; done;
      rm -rf "$work"' EXIT
for i in "${!sides[@]}"; do
    git -C "$repo" worktree add -q --detach "$work/${sides[$i]}" "${revs[$i]}"
done
for round in $(seq 1 "$rounds"); do
    for side in "${sides[@]}"; do
        load=$(cut -d' ' -f1-3 /proc/loadavg)
        echo "== round $round $side ($(git -C "$work/$side" rev-parse --short HEAD)), load $load"
        (cd "$work/$side" && PYTHONPATH="$work/$side" "$@" 2>&1) | sed "s/^/r$round $side | /" || true
    done
done
