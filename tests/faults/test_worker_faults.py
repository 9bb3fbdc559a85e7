"""A real ``celery worker`` (prefork) whose database turns read-only, or fails over to
a promoted standby: it waits, logging one line per attempt, and consumes again with
no restart. Each test runs on throwaway clusters of its own."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest
from celery import Celery
from celery_workers import Worker, WorkerApp
from clusters import Cluster
from failover_app import make_app
from psycopg import sql
from waiting import wait_for

import kombu_pgqueue

pytestmark = pytest.mark.celery

HERE = Path(__file__).resolve().parent
SCHEMA = "faults"


@pytest.fixture
def ledger(db: psycopg.Connection, schema: str) -> Callable[[], list[str]]:
    """A table on the shared server where each task writes its label; its reader."""
    table = sql.Identifier(schema, "ledger")
    db.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(schema)))
    db.execute(sql.SQL("CREATE TABLE {} (label text NOT NULL)").format(table))

    def labels() -> list[str]:
        rows = db.execute(sql.SQL("SELECT label FROM {}").format(table)).fetchall()
        return [label for (label,) in rows]

    return labels


@pytest.fixture
def worker_app(dsn: str, schema: str) -> WorkerApp:
    """``celery -A failover_app worker``: ``spawn(broker_url=URL, queues=None)``."""

    def env(broker_url: str) -> dict[str, str]:
        return {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parent)]),
            "PGQUEUE_BROKER_URL": broker_url,
            "PGQUEUE_SCHEMA": SCHEMA,
            "PGQUEUE_LEDGER_DSN": dsn,
            "PGQUEUE_LEDGER": f"{schema}.ledger",
        }

    return WorkerApp("failover_app", HERE, env)


@pytest.fixture
def client_for() -> Iterator[Callable[[str], Celery]]:
    """``client_for(broker_url)``: an app that sends ``failover_app``'s tasks there."""
    made: list[Celery] = []

    def client_for(broker_url: str) -> Celery:
        app = make_app(broker_url, SCHEMA)
        made.append(app)
        return app

    yield client_for
    for app in made:
        app.close()


def _quiet(log: str) -> None:
    """Waiting for a primary is one line per attempt, never a traceback."""
    assert "Traceback" not in log, log
    assert "RestartFreqExceeded" not in log, log


def test_a_worker_waits_out_a_read_only_database_and_consumes_after(
    primary: Cluster,
    spawn: Callable[..., Worker],
    client_for: Callable[[str], Celery],
    ledger: Callable[[], list[str]],
) -> None:
    kombu_pgqueue.migrate(primary.dsn, SCHEMA)
    url = f"pgqueue://postgres@127.0.0.1:{primary.port}/postgres"
    primary.set_read_only(True)
    worker = spawn(broker_url=url, queues=None)
    wait_for(lambda: worker.says("is read-only"), 30, "the worker to say it waits", worker)

    primary.set_read_only(False)
    client_for(url).send_task("failover.record", ("after",))

    wait_for(lambda: ledger() == ["after"], 60, "the task to run", worker)
    assert worker.proc.poll() is None
    _quiet(worker.log())


@pytest.mark.parametrize("form", ["failover list", "multi-host URL"])
def test_a_running_worker_follows_a_failover_to_the_promoted_standby(
    primary_and_standby: Callable[..., tuple[Cluster, Cluster]],
    spawn: Callable[..., Worker],
    client_for: Callable[[str], Celery],
    ledger: Callable[[], list[str]],
    form: str,
) -> None:
    primary, standby = primary_and_standby(synchronous=True)
    kombu_pgqueue.migrate(primary.dsn, SCHEMA)
    if form == "failover list":
        url = ";".join(
            f"pgqueue://postgres@127.0.0.1:{c.port}/postgres" for c in (primary, standby)
        )
    else:
        url = (
            "pgqueue+postgresql://postgres@/postgres?host=127.0.0.1,127.0.0.1"
            f"&port={primary.port},{standby.port}&target_session_attrs=read-write"
        )
    worker = spawn(broker_url=url, queues=None)
    app = client_for(url)
    app.send_task("failover.record", ("before",))
    wait_for(lambda: ledger() == ["before"], 60, "the first task to run", worker)

    primary.stop("immediate")
    standby.promote()
    app.send_task("failover.record", ("after",))

    # "before" may run again: its ack committed without waiting for the standby
    # (relax_consumer_commits), so the promoted standby may not have it
    wait_for(lambda: "after" in ledger(), 60, "a task after it", worker)
    assert worker.proc.poll() is None  # no restart
    _quiet(worker.log())
