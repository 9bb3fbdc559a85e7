"""A Celery app for the latency and drain probes: every task start goes to a trace file.

    PROBE_SCHEMA=probe_s PROBE_TRACE=/tmp/probe_trace.log celery -A lat_app worker ...

Each line is ``<epoch seconds> <pid> <event>``. With ``PROBE_STEPS=1`` the worker
also records when the LISTEN socket became readable, each claim's start and end, and
when the claim thread's result reached the event loop. ``PROBE_NO_IDLE=1`` sends every
claim through the claim thread (the A/B of idle consumers claiming inline).
"""

from __future__ import annotations

import os
import time
from typing import Any

from celery import Celery

from kombu_pgqueue import transport as pgq

SCHEMA = os.environ.get("PROBE_SCHEMA", "probe_s")
TRACE = os.environ.get("PROBE_TRACE", "/tmp/probe_trace.log")
DSN = os.environ.get("PROBE_BROKER", "pgqueue://postgres@127.0.0.1/test")

app = Celery("lat_app", broker=DSN)
app.conf.update(
    broker_transport_options={"schema": SCHEMA},
    worker_prefetch_multiplier=4,
    worker_hijack_root_logger=False,
)


def ev(name: str) -> None:
    with open(TRACE, "a") as f:
        f.write(f"{time.time():.6f} {os.getpid()} {name}\n")


if os.environ.get("PROBE_NO_IDLE") == "1":
    pgq.IDLE_INLINE_SECONDS = 1e9

if os.environ.get("PROBE_STEPS") == "1":
    _readable = pgq.Transport._on_readable
    _fetch = pgq.Channel.fetch
    _claimed = pgq.Transport._on_claimed

    def _on_readable(self: Any, fileno: int) -> None:
        ev("readable")
        _readable(self, fileno)

    def fetch(self: Any, queue: str, limit: int) -> list[dict[str, Any]]:
        ev("fetch_start")
        rows = _fetch(self, queue, limit)
        ev(f"fetch_end {len(rows)}")
        return rows

    def _on_claimed(self: Any, fileno: int | None = None) -> None:
        ev("on_claimed")
        _claimed(self, fileno)

    pgq.Transport._on_readable = _on_readable  # type: ignore[method-assign]
    pgq.Channel.fetch = fetch  # type: ignore[method-assign]
    pgq.Transport._on_claimed = _on_claimed  # type: ignore[method-assign]


@app.task(name="lat")
def lat(sent: float) -> None:
    ev(f"task_start {time.time() - sent:.6f}")


@app.task(name="noop")
def noop() -> None:
    ev("noop")
