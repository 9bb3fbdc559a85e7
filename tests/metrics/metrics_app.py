"""The Celery app that the metrics tests run in real processes, and their helpers.

``celery -A metrics_app worker|pgqueue ...`` builds the app from ``PGQUEUE_DSN`` and
``PGQUEUE_SCHEMA`` (see :func:`process_env`); the worker serves metrics on
``--pgqueue-metrics-port``, with the queue gauges, through
:func:`celery_pgqueue.metrics.install`. Its task ``metrics.hold`` runs until its gate
is opened (a row in the schema's ``gate`` table, see :func:`create_gates` and
``helpers.open_gate``), or at once.
"""

from __future__ import annotations

import os
import urllib.request
from functools import partial
from pathlib import Path

import psycopg
from celery import Celery
from celery_apps import celery_app, lazy_app
from celery_workers import app_env
from helpers import wait_gate
from prometheus_client.parser import text_string_to_metric_families
from psycopg import sql

from celery_pgqueue import metrics

HERE = Path(__file__).resolve().parent

#: how long a held task waits for its gate (it must never outlive a test)
GATE_LIMIT = 60.0

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


#: ``process_env(dsn, schema)``: the environment of a ``celery -A metrics_app ...``
#: process (or of an exporter)
process_env = partial(app_env, HERE)


def create_gates(conn: psycopg.Connection, schema: str) -> None:
    """The gate table of ``metrics.hold`` in ``schema`` (which must exist)."""
    conn.execute(
        sql.SQL("CREATE TABLE {} (name text PRIMARY KEY)").format(sql.Identifier(schema, "gate"))
    )


def make_app(dsn: str, schema: str) -> Celery:
    app = celery_app(
        dsn,
        schema,
        main="metrics_app",
        results=False,
        visibility_timeout=3,
        lease_renewal_interval=0.2,
        conf={
            "task_acks_late": True,
            "task_ignore_result": True,
            "worker_prefetch_multiplier": 1,
            # the worker process logs where its metrics are served
            "worker_hijack_root_logger": True,
        },
    )
    metrics.install(app, queues=True, min_interval=0.5)

    @app.task(name="metrics.hold", shared=False)
    def hold(gate: str | None = None) -> None:
        """Run until gate ``gate`` is opened (``helpers.open_gate``); without one, at once."""
        if gate is not None:
            wait_gate(dsn, schema, gate, GATE_LIMIT)

    @app.task(name="metrics.hold_early", shared=False, acks_late=False)
    def hold_early(gate: str | None = None) -> None:
        """:func:`hold`, its message acked (deleted) as it starts: Celery's default."""
        hold(gate)

    return app


__getattr__ = lazy_app(
    globals(), lambda: make_app(os.environ["PGQUEUE_DSN"], os.environ["PGQUEUE_SCHEMA"])
)
