"""Celery fixtures: an app on the test schema and a real in-process worker."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from celery import Celery
from celery.contrib.testing.worker import start_worker

import celery_pgqueue


@pytest.fixture
def celery_dsn(dsn: str) -> str:
    return dsn or "postgresql://"


@pytest.fixture
def app(celery_dsn: str, schema: str) -> Iterator[Celery]:
    app = Celery(f"test_{schema}", set_as_current=False)
    celery_pgqueue.configure(
        app,
        celery_dsn,
        schema=schema,
        polling_interval=0.5,
        visibility_timeout=10,
    )
    app.conf.update(
        result_backend_always_retry=False,
        task_default_queue="celery",
        worker_hijack_root_logger=False,
        broker_connection_retry_on_startup=True,
        # results from other tests' schemas share the table; ids are unique anyway
        database_short_lived_sessions=True,
    )
    yield app
    app.close()


@pytest.fixture
def worker(app: Celery) -> Iterator[object]:
    with start_worker(
        app, pool="threads", concurrency=4, perform_ping_check=True, shutdown_timeout=30
    ) as w:
        yield w
