"""The Celery app that the metrics tests run in real processes, and their helpers.

``celery -A metrics_app worker|pgqueue ...`` builds the app from ``PGQUEUE_DSN`` and
``PGQUEUE_SCHEMA``; the worker serves metrics on ``--pgqueue-metrics-port``, with the
queue gauges, through :func:`celery_pgqueue.metrics.install`.
"""

from __future__ import annotations

import os
import threading
import time
import urllib.request
from collections.abc import Callable
from typing import Any

from celery import Celery
from prometheus_client.parser import text_string_to_metric_families

import celery_pgqueue
from celery_pgqueue import metrics

#: {(sample name, sorted labels): value}
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(text: str) -> Samples:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def scrape(url: str) -> Samples:
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.status == 200
        return parse(response.read().decode())


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


def wait_for(condition: Callable[[], Any], timeout: float, what: str) -> Any:
    """Poll ``condition`` until it is truthy, at most ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        found = condition()
        if found:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        threading.Event().wait(0.1)


def make_app(dsn: str, schema: str) -> Celery:
    app = Celery("metrics_app", set_as_current=False)
    celery_pgqueue.configure(
        app,
        dsn,
        results=False,
        schema=schema,
        polling_interval=0.5,
        visibility_timeout=3,
        lease_renewal_interval=0.2,
    )
    app.conf.update(
        task_acks_late=True,
        task_ignore_result=True,
        task_default_queue="celery",
        worker_prefetch_multiplier=1,
    )
    metrics.install(app, queues=True, min_interval=0.5)

    @app.task(name="metrics.pause", shared=False)
    def pause(seconds: float) -> float:
        threading.Event().wait(seconds)
        return seconds

    return app


def __getattr__(name: str) -> Any:
    # built on first use, so tests can import the helpers without a worker's environment
    if name == "app":
        globals()["app"] = built = make_app(os.environ["PGQUEUE_DSN"], os.environ["PGQUEUE_SCHEMA"])
        return built
    raise AttributeError(name)
