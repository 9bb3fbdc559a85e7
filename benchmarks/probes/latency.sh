#!/usr/bin/env bash
# Idle-worker latency, apply_async -> task start, N sequential tasks 30 ms apart, on a
# prefork -c 2 worker: prints p50/p95/p99 (each hop: hops.py).
#   bash benchmarks/probes/latency.sh [N]
set -euo pipefail
cd "$(dirname "$0")"
export PROBE_TRACE=${PROBE_TRACE:-/tmp/probe_trace.log} PROBE_SCHEMA=${PROBE_SCHEMA:-probe_s}
python - <<'PY'
import os, psycopg
with psycopg.connect("host=127.0.0.1 dbname=test user=postgres", autocommit=True) as c:
    c.execute(f'DROP SCHEMA IF EXISTS "{os.environ["PROBE_SCHEMA"]}" CASCADE')
PY
rm -f "$PROBE_TRACE"
timeout 300 celery -A lat_app worker -P prefork -c 2 --without-mingle --without-gossip -l WARNING &
worker=$!
sleep 6
python - "${1:-300}" <<'PY'
import sys, time
from lat_app import ev, lat
lat.apply_async((time.time(),))
time.sleep(2)
for _ in range(int(sys.argv[1])):
    t = time.time()
    ev("send")
    lat.apply_async((t,))
    ev("sent")
    time.sleep(0.03)
PY
sleep 1
kill "$worker"; wait "$worker" || true
python - <<'PY'
import os, statistics
rows = [line.split(None, 2) for line in open(os.environ["PROBE_TRACE"])]
seq, cur = [], None
for t, _, name in rows:
    name = name.strip()
    if name == "send":
        cur = {"send": float(t)}
        seq.append(cur)
    elif cur is not None:
        key = name.split()[0]
        cur.setdefault(key, float(t))
        if key == "task_start":
            cur["lat"] = float(name.split()[1]) * 1000
seq = [s for s in seq[5:] if "lat" in s]
for key in ("sent", "readable", "fetch_start", "fetch_end", "on_claimed", "task_start"):
    vals = [(s[key] - s["send"]) * 1000 for s in seq if key in s]
    if vals:
        print(f"{key:12} p50 {statistics.median(vals):.3f} ms after apply_async began")
lat = sorted(s["lat"] for s in seq)
print(f"latency p50 {statistics.median(lat):.2f} p95 {lat[int(len(lat) * .95)]:.2f} "
      f"p99 {lat[int(len(lat) * .99)]:.2f} ms ({len(lat)} tasks)")
PY
