"""Fleet fixtures: worker processes of ``fleet_app`` and publishing processes, and the
sessions each holds on the server (pg_stat_activity, by application_name: the broker's
sessions are named ``pgqueue[<pid>]``; every other session of these processes gets the
``PGAPPNAME`` their environment sets, so none goes uncounted)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import psycopg
import pytest
from celery_workers import Worker, WorkerApp, app_env, workers
from held_sessions import Sessions

HERE = Path(__file__).resolve().parent


@pytest.fixture
def sessions(db: psycopg.Connection) -> Sessions:
    return Sessions(db)


def fleet_env(dsn: str, schema: str, sessions: Sessions, **options: object) -> dict[str, str]:
    """A fleet_app process's environment: each transport option as PGQUEUE_OPT_<NAME>,
    and the PGAPPNAME that names its sessions other than the broker's."""
    settings = {f"opt_{name}": value for name, value in options.items()}
    return {**app_env(HERE, dsn, schema, **settings), **sessions.env()}


@pytest.fixture
def fleet_worker(
    dsn: str, schema: str, sessions: Sessions, tmp_path: Path
) -> Iterator[Callable[..., Worker]]:
    """``fleet_worker(pool="prefork", concurrency=2, **transport_options)``: a ready
    ``celery -A fleet_app worker`` process, killed with its pool when the test ends."""
    with workers(tmp_path) as started:

        def spawn(pool: str = "prefork", concurrency: int = 2, **options: object) -> Worker:
            app = WorkerApp("fleet_app", HERE, partial(fleet_env, dsn, schema, sessions, **options))
            return started.spawn(app, pool=pool, concurrency=concurrency, ready=True)

        yield spawn


@pytest.fixture
def fleet_worker_at(
    schema: str, sessions: Sessions, tmp_path: Path
) -> Iterator[Callable[..., Worker]]:
    """``fleet_worker_at(dsn, pool="prefork", concurrency=2, **transport_options)``: as
    :func:`fleet_worker`, on the database of ``dsn`` (a pooler's, say)."""
    with workers(tmp_path) as started:

        def spawn(
            dsn: str, pool: str = "prefork", concurrency: int = 2, **options: object
        ) -> Worker:
            app = WorkerApp("fleet_app", HERE, partial(fleet_env, dsn, schema, sessions, **options))
            return started.spawn(app, pool=pool, concurrency=concurrency, ready=True)

        yield spawn


@pytest.fixture
def publishing(
    broker_base_url: str, schema: str, sessions: Sessions, dsn: str
) -> Iterator[Callable[..., subprocess.Popen[str]]]:
    """``publishing(threads, each, **transport_options)``: a process that published from
    ``threads`` threads at once and waits (it has printed "published")."""
    started: list[subprocess.Popen[str]] = []

    def start(threads: int, each: int, **options: object) -> subprocess.Popen[str]:
        args = [f"{k}={v}" for k, v in options.items()]
        proc = subprocess.Popen(
            [
                sys.executable,
                str(HERE / "publisher_proc.py"),
                broker_base_url,
                schema,
                str(threads),
                str(each),
                *args,
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=fleet_env(dsn, schema, sessions),
        )
        started.append(proc)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.strip() == "published", f"the publisher said {line!r}"
        return proc

    yield start
    for proc in started:
        proc.kill()
        proc.wait(timeout=10)
