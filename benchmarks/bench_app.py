"""The Celery app the benchmark workers run (``celery -A bench_app worker``).

One module for every broker: the broker URL, transport options, queue name and
sink file come from the environment, everything else is the same Celery
configuration for all brokers.

The sink is a local append-only file. Signal handlers in the worker processes
append one short line per task with ``os.write`` on an ``O_APPEND`` descriptor
(one system call, atomic for lines this short, no network, identical for every
broker), so the measurement itself puts no load on any broker:

* ``ready <t>``                  the worker is consuming (``worker_ready``)
* ``e <start> <end> <task_id>``  a ``bench.noop`` ran (``task_prerun``/``task_postrun``)
* ``l <sent> <start>``           a ``bench.latency`` task started; ``sent`` is the
                                 producer's ``time.time()`` just before ``apply_async``
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from celery import Celery, signals

import kombu_pgqueue  # noqa: F401 - registers pgqueue:// in every process, workers included

#: Celery settings shared by every broker (the harness prints them)
COMMON_SETTINGS: dict[str, Any] = {
    "broker_connection_retry_on_startup": True,
    "task_ignore_result": True,
    "result_backend": None,
    "task_serializer": "json",
    "accept_content": ["json"],
    "worker_prefetch_multiplier": 4,
    "worker_send_task_events": False,
    "task_send_sent_event": False,
    "worker_hijack_root_logger": True,
    "worker_redirect_stdouts": False,
}

_sink_fd: int | None = None
_starts: dict[str, float] = {}


def _write(line: str) -> None:
    if _sink_fd is not None:
        os.write(_sink_fd, line.encode())


def make_app(
    broker: str, transport_options: dict[str, Any], queue: str, sink: str | None = None
) -> Celery:
    """A Celery app for ``broker`` whose default queue is ``queue``.

    With ``sink`` (worker side), the signal handlers that record timings are connected.
    """
    global _sink_fd
    app = Celery("bench_app", broker=broker, set_as_current=False)
    app.conf.update(
        COMMON_SETTINGS,
        broker_transport_options=dict(transport_options),
        task_default_queue=queue,
        task_default_exchange=queue,
        task_default_routing_key=queue,
    )

    @app.task(name="bench.noop", shared=False)
    def noop() -> None:
        return None

    @app.task(name="bench.latency", shared=False)
    def latency(sent: float) -> None:
        started = time.time()
        _write(f"l {sent!r} {started!r}\n")

    if sink:
        _sink_fd = os.open(sink, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        signals.worker_ready.connect(_on_ready, weak=False)
        signals.task_prerun.connect(_on_prerun, weak=False)
        signals.task_postrun.connect(_on_postrun, weak=False)
    return app


def _on_ready(**kwargs: Any) -> None:
    _write(f"ready {time.time()!r}\n")


def _on_prerun(task_id: str | None = None, task: Any = None, **kwargs: Any) -> None:
    if task is not None and task.name == "bench.noop" and task_id:
        _starts[task_id] = time.time()


def _on_postrun(task_id: str | None = None, task: Any = None, **kwargs: Any) -> None:
    if task is not None and task.name == "bench.noop" and task_id:
        end = time.time()
        start = _starts.pop(task_id, end)
        _write(f"e {start!r} {end!r} {task_id}\n")


if os.environ.get("BENCH_BROKER_URL"):
    app = make_app(
        os.environ["BENCH_BROKER_URL"],
        json.loads(os.environ.get("BENCH_TRANSPORT_OPTIONS") or "{}"),
        os.environ.get("BENCH_QUEUE", "bench"),
        os.environ.get("BENCH_SINK") or None,
    )
