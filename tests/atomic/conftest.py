"""Fixtures of the atomic-task tests: the tables, real ``celery worker`` processes and
the queries that count what happened (see ``atomic_app``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from atomic_app import create_tables, make_app, worker_env
from celery import Celery
from psycopg import sql
from waiting import Process

import kombu_pgqueue

HERE = Path(__file__).resolve().parent

#: what the transport logs when acks find their rows gone ("ack of message 1 came after
#: its lease ended", "3 of 8 acks came after their lease ended"): never, here
LATE_ACK = "lease ended"


class Worker(Process):
    def kill(self) -> None:
        """SIGKILL the main process and its pool children at once."""
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)


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
def spawn(dsn: str, tables: str, tmp_path: Path) -> Iterator[Callable[..., Worker]]:
    """``spawn(pool, concurrency=2, prefetch=1, **transport_options)``: a worker process."""
    started: list[Worker] = []

    def spawn(pool: str, *, concurrency: int = 2, prefetch: int = 1, **options: Any) -> Worker:
        name = f"{pool}{len(started)}"
        log_path = tmp_path / f"worker-{name}.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "celery",
                    "-A",
                    "atomic_app",
                    "worker",
                    "-n",
                    f"{name}@%h",
                    "-P",
                    pool,
                    "-c",
                    str(concurrency),
                    "--prefetch-multiplier",
                    str(prefetch),
                    "-Q",
                    "celery",
                    "-l",
                    "info",
                    "--without-mingle",
                    "--without-gossip",
                    "--without-heartbeat",
                ],
                cwd=HERE,
                env=worker_env(dsn, tables, **options),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        worker = Worker(name, proc, log_path)
        started.append(worker)
        return worker

    try:
        yield spawn
    finally:
        for worker in started:
            try:
                os.killpg(worker.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            worker.proc.wait(timeout=10)


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
            ).format(sql.Identifier(schema, "message"))
        ).fetchall()
