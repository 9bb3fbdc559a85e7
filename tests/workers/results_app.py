"""An app whose result tables live in its broker's schema (Celery's
``database_table_schemas``, as docs/configuration.md shows), for ``celery -A results_app
worker``: built from ``PGQUEUE_DSN`` and ``PGQUEUE_SCHEMA`` (see ``lifecycle_app.worker_env``).
"""

from __future__ import annotations

import os

from celery import Celery
from celery_apps import celery_app, lazy_app


def make_app(dsn: str, schema: str) -> Celery:
    app = celery_app(
        dsn,
        schema,
        main="results_schema",
        conf={
            "database_table_schemas": {"task": schema, "group": schema},
            "worker_hijack_root_logger": True,
        },
    )

    @app.task(name="results.add", shared=False)
    def add(x: int, y: int) -> int:
        return x + y

    return app


__getattr__ = lazy_app(
    globals(), lambda: make_app(os.environ["PGQUEUE_DSN"], os.environ["PGQUEUE_SCHEMA"])
)
