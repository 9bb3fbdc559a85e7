"""Fixtures of the periodic task tests: the app, in-process schedulers on a moved clock,
real ``celery beat`` processes, and the sends counted in the broker's tables."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from celery import Celery
from celery_workers import Workers, workers
from periodic_app import HERE, make_app, process_env

import kombu_pgqueue
from kombu_pgqueue import admin


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
