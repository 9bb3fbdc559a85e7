#!/usr/bin/env bash
# Prefork -c 2 drain of N no-op tasks loaded with send_many: prints tasks/s from the
# first to the last task start.   bash benchmarks/probes/drain.sh [N]
set -euo pipefail
cd "$(dirname "$0")"
export PROBE_TRACE=${PROBE_TRACE:-/tmp/probe_trace.log} PROBE_SCHEMA=${PROBE_SCHEMA:-probe_s}
N=${1:-20000}
python - "$N" <<'PY'
import os, sys, psycopg
with psycopg.connect("host=127.0.0.1 dbname=test user=postgres", autocommit=True) as c:
    c.execute(f'DROP SCHEMA IF EXISTS "{os.environ["PROBE_SCHEMA"]}" CASCADE')
from celery_pgqueue.bulk import send_many
from lat_app import app, noop
send_many(app, (noop.s() for _ in range(int(sys.argv[1]))))
PY
rm -f "$PROBE_TRACE"
timeout 300 celery -A lat_app worker -P prefork -c 2 --without-mingle --without-gossip -l WARNING &
worker=$!
python - "$N" <<'PY'
import os, sys, time
n = int(sys.argv[1])
while True:
    time.sleep(1)
    try:
        with open(os.environ["PROBE_TRACE"]) as f:
            if sum(1 for _ in f) >= n:
                break
    except FileNotFoundError:
        pass
ts = [float(line.split()[0]) for line in open(os.environ["PROBE_TRACE"])]
print(f"drain {(len(ts) - 1) / (max(ts) - min(ts)):.0f} tasks/s ({len(ts)} tasks)")
PY
kill "$worker"; wait "$worker" || true
