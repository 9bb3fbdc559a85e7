"""Celery fixtures: a real in-process worker on the ``app`` of ``tests/conftest.py``;
``celery -A lifecycle_app worker`` processes (``spawn``, ``tests/conftest.py``) and the
app that sends them tasks (``publisher``)."""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import psycopg
import pytest
from celery import Celery
from celery.contrib.testing.worker import start_worker
from celery_workers import WorkerApp
from ledger import create_ledger
from lifecycle_app import make_app, worker_env

import kombu_pgqueue

HERE = Path(__file__).resolve().parent


@pytest.fixture
def worker(app: Celery) -> Iterator[object]:
    with start_worker(
        app, pool="threads", concurrency=4, perform_ping_check=True, shutdown_timeout=30
    ) as w:
        yield w


@pytest.fixture
def lifecycle_options() -> dict[str, Any]:
    """Transport options of both ``publisher`` and the spawned workers (a module may
    override it)."""
    return {}


@pytest.fixture
def worker_app(dsn: str, schema: str, lifecycle_options: dict[str, Any]) -> WorkerApp:
    """``celery -A lifecycle_app worker``; ``spawn``'s settings are ``worker_env``'s."""
    return WorkerApp("lifecycle_app", HERE, partial(worker_env, dsn, schema, **lifecycle_options))


@pytest.fixture
def publisher(
    dsn: str, schema: str, db: psycopg.Connection, lifecycle_options: dict[str, Any]
) -> Iterator[Celery]:
    """An app that sends the tasks; the schema and the ledger exist before any worker."""
    kombu_pgqueue.migrate(dsn, schema)
    create_ledger(db, schema)
    app = make_app(dsn, schema, **lifecycle_options)
    try:
        yield app
    finally:
        app.close()
