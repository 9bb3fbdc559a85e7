"""Fixtures of the atomic-task tests: the tables, real ``celery worker`` processes and
the queries that count what happened (see ``atomic_app``)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import psycopg
import pytest
from atomic_app import create_tables, make_app, worker_env
from celery import Celery
from celery_workers import WorkerApp
from psycopg import sql

import kombu_pgqueue

HERE = Path(__file__).resolve().parent

#: what the transport logs when acks find their rows gone ("ack of message 1 came after
#: its lease ended", "3 of 8 acks came after their lease ended"): never, here
LATE_ACK = "lease ended"


@pytest.fixture
def tables(dsn: str, schema: str, db: psycopg.Connection) -> str:
    """The broker schema, migrated, with the tables of ``atomic_app``."""
    kombu_pgqueue.migrate(dsn, schema)
    create_tables(db, schema)
    return schema


@pytest.fixture
def client(dsn: str, tables: str) -> Iterator[Celery]:
    """The app that sends the tasks and reads their results."""
    app = make_app(dsn, tables)
    try:
        yield app
    finally:
        app.close()


@pytest.fixture
def worker_app(dsn: str, tables: str) -> WorkerApp:
    """What ``spawn(pool=..., **transport_options)`` starts (``tests/conftest.py``)."""
    return WorkerApp("atomic_app", HERE, partial(worker_env, dsn, tables))


def effects(db: psycopg.Connection, schema: str) -> Counter[str]:
    """How many committed effect rows each key has."""
    rows = db.execute(sql.SQL("SELECT key FROM {}").format(sql.Identifier(schema, "effect")))
    return Counter(key for (key,) in rows)


def attempts(db: psycopg.Connection, schema: str) -> Counter[str]:
    """How many times each key's task body started."""
    rows = db.execute(sql.SQL("SELECT key FROM {}").format(sql.Identifier(schema, "attempt")))
    return Counter(key for (key,) in rows)


def messages(db: psycopg.Connection, schema: str) -> list[dict[str, Any]]:
    """The committed message rows (task name, first argument, lease) of the schema."""
    with db.cursor(row_factory=psycopg.rows.dict_row) as cur:
        return cur.execute(
            sql.SQL(
                "SELECT id, headers->>'task' AS task, body, lease, attempts FROM {} ORDER BY id"
            ).format(sql.Identifier(schema, "message_store"))
        ).fetchall()
