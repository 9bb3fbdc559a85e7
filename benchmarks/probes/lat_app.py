"""A Celery app for the latency and drain probes: every task start goes to a trace file.

    PROBE_SCHEMA=probe_s PROBE_TRACE=/tmp/probe_trace.log celery -A lat_app worker ...

Each line is ``<epoch seconds> <pid> <event>`` (hop by hop: ``hops.py``).
``PROBE_NO_IDLE=1`` sends every claim
without waiting (the A/B of idle consumers claiming inline). ``PROBE_SWITCH`` sets the
worker's ``sys.setswitchinterval``; ``PROBE_OPTS`` is JSON merged into the transport
options (``PROBE_OPTS='{"async_claims": false}'``).
"""

from __future__ import annotations

import os
import time

from celery import Celery

SCHEMA = os.environ.get("PROBE_SCHEMA", "probe_s")
TRACE = os.environ.get("PROBE_TRACE", "/tmp/probe_trace.log")
DSN = os.environ.get("PROBE_BROKER", "pgqueue://postgres@127.0.0.1/test")

app = Celery("lat_app", broker=DSN)
NO_IDLE = {"idle_inline_seconds": 1e9} if os.environ.get("PROBE_NO_IDLE") == "1" else {}
app.conf.update(
    broker_transport_options={"schema": SCHEMA, **NO_IDLE},
    worker_prefetch_multiplier=4,
    worker_hijack_root_logger=False,
)


def ev(name: str) -> None:
    with open(TRACE, "a") as f:
        f.write(f"{time.time():.6f} {os.getpid()} {name}\n")


@app.task(name="lat")
def lat(sent: float) -> None:
    ev(f"task_start {time.time() - sent:.6f}")


@app.task(name="noop")
def noop() -> None:
    ev("noop")


if os.environ.get("PROBE_SWITCH"):
    import sys

    sys.setswitchinterval(float(os.environ["PROBE_SWITCH"]))
if os.environ.get("PROBE_OPTS"):
    import json

    app.conf.broker_transport_options.update(json.loads(os.environ["PROBE_OPTS"]))
