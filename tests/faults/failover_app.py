"""The Celery app of the fault tests' worker processes: ``celery -A failover_app worker``.

* ``PGQUEUE_BROKER_URL``: the broker URL as a user writes it (a failover list, a
  multi-host libpq URL), on a throwaway cluster.
* ``PGQUEUE_SCHEMA``: the broker schema.
* ``PGQUEUE_LEDGER_DSN`` and ``PGQUEUE_LEDGER``: where each task writes its label
  (a table on the shared test server, which no fault touches).
"""

from __future__ import annotations

import os

import psycopg
from celery import Celery
from celery_apps import celery_app, lazy_app
from psycopg import sql


def make_app(broker_url: str, schema: str) -> Celery:
    app = celery_app(
        broker_url,
        schema,
        main="failover",
        results=False,
        statement_timeout=5,
        conf={
            "broker_connection_max_retries": None,
            "task_acks_late": True,
            "task_ignore_result": True,
            "worker_hijack_root_logger": True,
        },
    )
    ledger_dsn = os.environ.get("PGQUEUE_LEDGER_DSN", "")
    ledger = sql.Identifier(*os.environ.get("PGQUEUE_LEDGER", "public.ledger").split("."))

    @app.task(name="failover.record", shared=False)
    def record(label: str) -> None:
        with psycopg.connect(ledger_dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("INSERT INTO {} (label) VALUES (%s)").format(ledger), [label])

    return app


__getattr__ = lazy_app(
    globals(),
    lambda: make_app(
        os.environ.get("PGQUEUE_BROKER_URL", "pgqueue://"),
        os.environ.get("PGQUEUE_SCHEMA", "pgqueue"),
    ),
)
