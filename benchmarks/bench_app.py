"""The Celery app the benchmark workers run (``celery -A benchmarks.bench_app worker``).

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
from collections.abc import Mapping
from typing import Any

from celery import Celery, signals

import kombu_pgqueue  # noqa: F401 - registers pgqueue:// in every process, workers included

#: Celery settings shared by every broker (the harness prints them)
COMMON_SETTINGS: Mapping[str, Any] = {
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


class _Recorder:
    """The sink of one worker process: the signal handlers' lines, appended one write each."""

    def __init__(self, sink: str | None) -> None:
        self.fd = os.open(sink, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644) if sink else None
        self.starts: dict[str, float] = {}

    def write(self, line: str) -> None:
        if self.fd is not None:
            os.write(self.fd, line.encode())

    def on_ready(self, **kwargs: Any) -> None:
        self.write(f"ready {time.time()!r}\n")

    def on_prerun(self, task_id: str | None = None, task: Any = None, **kwargs: Any) -> None:
        if task is not None and task.name == "bench.noop" and task_id:
            self.starts[task_id] = time.time()

    def on_postrun(self, task_id: str | None = None, task: Any = None, **kwargs: Any) -> None:
        if task is not None and task.name == "bench.noop" and task_id:
            end = time.time()
            start = self.starts.pop(task_id, end)
            self.write(f"e {start!r} {end!r} {task_id}\n")


def make_app(
    broker: str, transport_options: dict[str, Any], queue: str, sink: str | None = None
) -> Celery:
    """A Celery app for ``broker`` whose default queue is ``queue``.

    With ``sink`` (worker side), the signal handlers that record timings are connected.
    """
    recorder = _Recorder(sink)
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
        recorder.write(f"l {sent!r} {started!r}\n")

    if sink:
        signals.worker_ready.connect(recorder.on_ready, weak=False)
        signals.task_prerun.connect(recorder.on_prerun, weak=False)
        signals.task_postrun.connect(recorder.on_postrun, weak=False)
    return app


#: the app ``celery -A benchmarks.bench_app worker`` finds (the harness sets the environment)
if os.environ.get("BENCH_BROKER_URL"):
    app = make_app(
        os.environ["BENCH_BROKER_URL"],
        json.loads(os.environ.get("BENCH_TRANSPORT_OPTIONS") or "{}"),
        os.environ.get("BENCH_QUEUE", "bench"),
        os.environ.get("BENCH_SINK") or None,
    )
