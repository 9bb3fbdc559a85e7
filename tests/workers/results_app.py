"""An app with Celery's result backend on its broker's database, for ``celery -A
results_app worker``: built from ``PGQUEUE_DSN`` and ``PGQUEUE_SCHEMA`` (see
``lifecycle_app.worker_env``). Its result tables live in its broker's schema (Celery's
``database_table_schemas``, as docs/configuration.md shows), or, with
``PGQUEUE_RESULT_TABLES=public``, where ``configure()`` puts them by default; with
``PGQUEUE_RESULT_TABLES=by-hand`` the backend is set by hand (``configure(...,
results=False)``, then ``result_backend``), as an app moved from another broker may.
"""

from __future__ import annotations

import os

from celery import Celery
from celery_apps import celery_app, lazy_app

import celery_pgqueue


def make_app(dsn: str, schema: str, *, tables: str = "schema") -> Celery:
    """``tables``: ``"schema"``, ``"public"`` or ``"by-hand"`` (see the module)."""
    conf: dict[str, object] = {"worker_hijack_root_logger": True}
    if tables == "schema":
        conf["database_table_schemas"] = {"task": schema, "group": schema}
    elif tables == "by-hand":
        conf["result_backend"] = celery_pgqueue.result_backend_url(dsn)
    app = celery_app(dsn, schema, main="results_schema", results=tables != "by-hand", conf=conf)

    @app.task(name="results.add", shared=False)
    def add(x: int, y: int) -> int:
        return x + y

    return app


__getattr__ = lazy_app(
    globals(),
    lambda: make_app(
        os.environ["PGQUEUE_DSN"],
        os.environ["PGQUEUE_SCHEMA"],
        tables=os.environ.get("PGQUEUE_RESULT_TABLES", "schema"),
    ),
)
