"""Fixtures of the failed-task archive tests: the schema with its gate and runs tables,
a client app, and real ``celery -A archive_app worker`` processes (prefork)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import psycopg
import pytest
from archive_app import create_tables, make_app
from celery import Celery
from celery_workers import WorkerApp, app_env

import kombu_pgqueue

HERE = Path(__file__).resolve().parent


#: ``worker_env(dsn, schema, **settings)``: the environment of ``celery -A archive_app
#: ...``; ``settings`` are ``PGQUEUE_*`` variables without the prefix, in lower case
#: (``keep_failed=0``)
worker_env = partial(app_env, HERE)


@pytest.fixture
def client(dsn: str, schema: str, db: psycopg.Connection) -> Iterator[Celery]:
    """The app that sends the tasks and reads their results; the schema and its tables
    exist before any worker starts."""
    kombu_pgqueue.migrate(dsn, schema)
    create_tables(db, schema)
    app = make_app(dsn, schema)
    try:
        yield app
    finally:
        app.close()


@pytest.fixture
def worker_app(dsn: str, schema: str) -> WorkerApp:
    """``celery -A archive_app worker``; ``spawn``'s settings are ``worker_env``'s
    (``spawn(name, ready=True, keep_failed=0)``, ``tests/conftest.py``)."""
    return WorkerApp("archive_app", HERE, partial(worker_env, dsn, schema))


@pytest.fixture
def cli(dsn: str, schema: str) -> Callable[..., subprocess.CompletedProcess[str]]:
    """``cli(*args)``: ``celery -A archive_app pgqueue ARGS`` as a user runs it."""

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            [sys.executable, "-m", "celery", "-A", "archive_app", "pgqueue", *args],
            cwd=HERE,
            env=worker_env(dsn, schema),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, (args, done.stdout, done.stderr)
        return done

    return run
