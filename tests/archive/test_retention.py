"""Failed tasks are kept by default, for a while (issue 32, item 4): the README says
"nothing is dropped silently", and a failed task was kept only with ``keep_failed=True``.
``configure()`` turns the archive on unless told otherwise, a worker says so in its
log, and its sweep deletes the letters kept longer than ``pgqueue_keep_failed_for``,
so the table cannot grow without bound."""

from __future__ import annotations

from datetime import timedelta

import psycopg
import pytest
from celery import Celery
from psycopg import sql
from waiting import wait_for

import celery_pgqueue
from celery_pgqueue import archive
from kombu_pgqueue.admin import Broker

pytestmark = pytest.mark.celery


def test_configure_keeps_failed_tasks_unless_told_not_to() -> None:
    app = Celery(set_as_current=False)
    celery_pgqueue.configure(app, "pgqueue://db/jobs")
    assert app.conf.pgqueue_keep_failed is True
    assert archive.retention(app.conf) == timedelta(days=7)

    chose = Celery(set_as_current=False)
    chose.conf.pgqueue_keep_failed = False
    celery_pgqueue.configure(chose, "pgqueue://db/jobs")  # the app's own choice stays
    assert chose.conf.pgqueue_keep_failed is False


def _letter(db: psycopg.Connection, schema: str, id: int, reason: str, days_ago: int) -> None:
    """A dead letter of ``reason`` that died ``days_ago`` days ago."""
    db.execute(
        sql.SQL(
            "INSERT INTO {} (id, queue, priority, attempts, reason, created_at, died_at, body, "
            "headers, properties) VALUES (%(id)s, 'celery', 0, 1, %(reason)s, now(), "
            "now() - make_interval(days => %(days)s), '', '{{}}', '{{}}')"
        ).format(sql.Identifier(schema, "dead_letter")),
        {"id": id, "reason": reason, "days": days_ago},
    )


def test_a_worker_keeps_failed_tasks_by_default_and_its_sweep_trims_them(
    client: Celery, spawn, db: psycopg.Connection, schema: str, dsn: str
) -> None:
    broker = Broker(dsn, schema=schema)
    _letter(db, schema, -1, "failed", 8)  # older than a week: trimmed as the worker starts
    _letter(db, schema, -2, "rejected", 30)  # not the sweep's to trim
    worker = spawn("default", ready=True, keep_failed="default", sweep_interval=0.1)
    assert worker.says(
        "pgqueue: tasks that fail for good are kept as dead letters for 7 days "
        "(celery pgqueue dead list --reason failed"
    )
    client.tasks["archive.charge"].delay("kept", 1)

    def failed_ids() -> list[int]:
        return [d.id for d in broker.dead_letters(reason="failed")]

    wait_for(
        lambda: len(failed_ids()) == 1 and failed_ids()[0] > 0,
        60,
        "the failed task kept, the old one trimmed",
        worker,
        details=failed_ids,
    )
    assert [d.reason for d in broker.dead_letters()] == ["rejected", "failed"]


def test_trim_deletes_failed_letters_older_than_the_retention(
    client: Celery, db: psycopg.Connection, schema: str, later
) -> None:
    for id, reason in enumerate(["failed", "failed", "max_attempts"], 1):
        _letter(db, schema, id, reason, 0)
    _letter(db, schema, 4, "failed", 2)
    client.conf.pgqueue_keep_failed_for = timedelta(days=1)

    assert archive.trim(client) == 1  # the one that died two days ago
    assert archive.trim(client, now=later(3600)) == 0
    client.conf.pgqueue_keep_failed_for = None  # for ever
    assert archive.trim(client, now=later(30 * 86400)) == 0
    client.conf.pgqueue_keep_failed_for = 60.0  # seconds
    assert archive.trim(client, now=later(3600)) == 2
    remaining = db.execute(
        sql.SQL("SELECT reason FROM {}").format(sql.Identifier(schema, "dead_letter"))
    ).fetchall()
    assert remaining == [("max_attempts",)]
