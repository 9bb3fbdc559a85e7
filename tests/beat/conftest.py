"""Fixtures of the periodic task tests: the app, in-process schedulers on a moved clock,
real ``celery beat`` processes, and the sends counted in the broker's tables."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import psycopg
import pytest
from celery import Celery
from celery_workers import Workers, workers
from periodic_app import make_app
from psycopg import sql

import kombu_pgqueue
from kombu_pgqueue import admin

HERE = Path(__file__).resolve().parent


def process_env(dsn: str, schema: str, **settings: Any) -> dict[str, str]:
    """The environment of ``celery -A periodic_app ...``; ``settings`` are ``PGQUEUE_*``
    variables without the prefix, in lower case."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")]
        ).rstrip(os.pathsep),
        "PGQUEUE_DSN": dsn,
        "PGQUEUE_SCHEMA": schema,
    }
    env.update({f"PGQUEUE_{key.upper()}": str(value) for key, value in settings.items()})
    return env


@dataclass(frozen=True, slots=True)
class Sent:
    """A message a beat sent: its entry, its due time and when it was stored."""

    entry: str
    due: datetime
    stored: datetime


def sent(db: psycopg.Connection, schema: str) -> list[Sent]:
    """Every periodic send in the schema's queues, by due time."""
    rows = db.execute(
        sql.SQL(
            "SELECT headers->>'pgqueue_beat_entry', (headers->>'pgqueue_beat_due')::timestamptz,"
            " created_at FROM {} WHERE headers->>'pgqueue_beat_entry' IS NOT NULL"
            " ORDER BY 2, 1"
        ).format(sql.Identifier(schema, "message_store"))
    ).fetchall()
    return [Sent(*row) for row in rows]


@pytest.fixture
def periodic(dsn: str, schema: str) -> Iterator[Celery]:
    """The app, its schema installed; no beat_schedule."""
    kombu_pgqueue.migrate(dsn, schema)
    app = make_app(dsn, schema)
    try:
        yield app
    finally:
        app.close()


@pytest.fixture
def broker(periodic: Celery) -> admin.Broker:
    with periodic.connection_for_write() as conn:
        return admin.Broker.from_connection(conn)


@pytest.fixture
def beats(tmp_path: Path) -> Iterator[Workers]:
    """Real ``celery beat`` processes, killed when the test ends."""
    with workers(tmp_path) as started:
        yield started


@pytest.fixture
def cli(dsn: str, schema: str) -> Callable[..., subprocess.CompletedProcess[str]]:
    """``cli(*args)``: ``celery -A periodic_app pgqueue ARGS`` as a user runs it."""

    def run(*args: str, ok: bool = True) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            [sys.executable, "-m", "celery", "-A", "periodic_app", "pgqueue", *args],
            cwd=HERE,
            env=process_env(dsn, schema),
            capture_output=True,
            text=True,
            timeout=60,
        )
        if ok:
            assert done.returncode == 0, (args, done.stdout, done.stderr)
        return done

    return run
