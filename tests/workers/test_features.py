"""Celery features end to end on pgqueue: beat, broadcast queues, Reject, expires,
inspect/revoke, remote shutdown, reply-queue cleanup, pools and prefetch.

Every test runs a real worker (in-process, or ``celery`` processes built by
``beat_app``) and counts task executions in a ledger table rather than trusting
results or logs.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import celery.contrib.testing.tasks  # noqa: F401 - registers celery.ping for the ping check
import psycopg
import pytest
from beat_app import make_app, process_env
from celery import Celery
from celery.contrib.testing.worker import start_worker
from celery.exceptions import Reject
from celery_apps import celery_app
from celery_workers import WorkerApp, workers
from ledger import Ledger, create_ledger, runs
from psycopg import sql
from psycopg.rows import dict_row
from waiting import wait_for

import kombu_pgqueue

pytestmark = pytest.mark.celery

HERE = Path(__file__).resolve().parent
REPLY_QUEUES = "%.reply.celery.pidbox"


# -- helpers ------------------------------------------------------------------------


def _rows(db: psycopg.Connection, query: str, schema: str, *params: Any) -> list[dict[str, Any]]:
    with db.cursor(row_factory=dict_row) as cur:
        return cur.execute(sql.SQL(query).format(s=sql.Identifier(schema)), params).fetchall()


def messages(db: psycopg.Connection, schema: str) -> list[dict[str, Any]]:
    return _rows(
        db,
        """
        SELECT id, queue, headers->>'id' AS task_id, attempts, lease, expires_at,
               lease IS NOT NULL AND next_iteration > clock_timestamp() AS leased
        FROM {s}.message_store
        ORDER BY id
        """,
        schema,
    )


def dead_letters(db: psycopg.Connection, schema: str) -> list[dict[str, Any]]:
    return _rows(
        db,
        "SELECT id, queue, headers->>'id' AS task_id, attempts, reason "
        "FROM {s}.dead_letter ORDER BY id",
        schema,
    )


def labels(db: psycopg.Connection, schema: str) -> list[str]:
    return [r["label"] for r in runs(db, schema)]


def past_expiry(db: psycopg.Connection, schema: str, task_id: str) -> bool:
    """The message of ``task_id`` has expired by the server's clock (the broker's)."""
    query = "SELECT 1 FROM {s}.message_store WHERE headers->>'id' = %s AND expires_at <= now()"
    return bool(_rows(db, query, schema, task_id))


@pytest.fixture
def ledger(dsn: str, schema: str, db: psycopg.Connection) -> Ledger:
    """The schema, migrated before any worker, with the ledger tables in it."""
    kombu_pgqueue.migrate(dsn, schema)
    create_ledger(db, schema)
    return Ledger(dsn, schema)


@pytest.fixture
def worker_app(dsn: str, schema: str, ledger: Ledger) -> WorkerApp:
    """``celery -A beat_app worker`` (``spawn``); settings are ``process_env``'s."""
    return WorkerApp("beat_app", HERE, partial(process_env, dsn, schema))


@pytest.fixture
def client(dsn: str, schema: str, ledger: Ledger) -> Iterator[Celery]:
    """The app that sends the tasks, with the broadcast queue ``bcast``."""
    app = make_app(dsn, schema, broadcast="bcast")
    try:
        yield app
    finally:
        app.close()


def ledger_tasks(app: Celery, ledger: Ledger) -> Any:
    """An in-process task on the ``app`` fixture that writes to the ledger."""

    @app.task(name="feat.record", shared=False, bind=True)
    def record(self: Any, label: str) -> str:
        ledger.finish(ledger.start(self, label))
        return label

    return record


def hold_task(app: Celery, ledger: Ledger, started: threading.Event, release: threading.Event):
    """An in-process task that runs until ``release`` is set."""

    @app.task(name="feat.hold", shared=False, bind=True)
    def hold(self: Any) -> str:
        run = ledger.start(self, "hold")
        started.set()
        wait_for(release, 30, "the test to release the held task")
        ledger.finish(run)
        return "held"

    return hold


# -- 1. celery beat ---------------------------------------------------------------


def test_beat_schedules_through_pgqueue(spawn, db, dsn, schema, tmp_path):
    worker = spawn("beat-worker@feat", pool="threads", queues=None)
    schedule = str(tmp_path / "schedule")
    with workers(tmp_path) as started:
        beat = started.run(
            "beat",
            ["-A", "beat_app", "beat", "-s", schedule, "--max-interval", "1", "-l", "info"],
            cwd=HERE,
            env=process_env(dsn, schema, beat_every=1),
        )
        wait_for(
            lambda: sum(r["finished_at"] is not None for r in runs(db, schema)) >= 3,
            20,
            "3 ticks sent by beat to run",
            worker,
            beat,
        )
    rows = runs(db, schema)
    assert {r["label"] for r in rows} == {"tick"}
    assert {r["hostname"] for r in rows} == {"beat-worker@feat"}
    assert len({r["task_id"] for r in rows}) == len(rows)  # each tick ran once
    assert "Scheduler: Sending due task tick (feat.record)" in beat.log()
    assert "Traceback" not in worker.log() + beat.log()


# -- 2. broadcast queues ------------------------------------------------------------


def test_broadcast_task_runs_once_on_every_worker(spawn, client, db, schema):
    a = spawn("bcast-a@feat", pool="threads", queues=None, broadcast="bcast")
    b = spawn("bcast-b@feat", pool="threads", queues=None, broadcast="bcast")
    wait_for(lambda: a.says(" ready.") and b.says(" ready."), 30, "workers a and b ready", a, b)
    bound = _rows(
        db, "SELECT queue FROM {s}.binding WHERE exchange = 'bcast' ORDER BY queue", schema
    )
    # one queue per worker process; the client declares none of its own
    assert len(bound) == 2 and all(r["queue"].startswith("bcast.") for r in bound), bound

    fanout = client.send_task("feat.record", ("fanout",), queue="bcast").id
    direct = client.send_task("feat.record", ("direct",)).id
    wait_for(
        lambda: (
            sorted(labels(db, schema)) == ["direct", "fanout", "fanout"]
            and not messages(db, schema)
        ),
        20,
        "the broadcast task on both workers and the plain one on either",
        a,
        b,
    )
    # one more round trip on each worker: nothing else arrives late
    later = client.send_task("feat.record", ("later",), queue="bcast").id
    wait_for(lambda: labels(db, schema).count("later") == 2, 20, "the second broadcast", a, b)

    rows = runs(db, schema)
    by_label: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_label.setdefault(row["label"], []).append(row)
    for label, task_id in (("fanout", fanout), ("later", later)):
        assert sorted(r["hostname"] for r in by_label[label]) == ["bcast-a@feat", "bcast-b@feat"]
        assert {r["task_id"] for r in by_label[label]} == {task_id}
    assert [r["task_id"] for r in by_label["direct"]] == [direct]
    assert dead_letters(db, schema) == []


# -- 3. Reject ----------------------------------------------------------------------


def test_reject_without_requeue_dead_letters_and_with_requeue_runs_again(app, ledger, db, schema):
    @app.task(name="feat.reject_dead", shared=False, bind=True, acks_late=True)
    def reject_dead(self: Any) -> None:
        ledger.finish(ledger.start(self, "dead"))
        raise Reject("no thanks", requeue=False)

    @app.task(name="feat.reject_once", shared=False, bind=True, acks_late=True)
    def reject_once(self: Any) -> str:
        ledger.finish(ledger.start(self, "once"))
        if not self.request.delivery_info.get("redelivered"):
            raise Reject("not yet", requeue=True)
        return "second delivery"

    with start_worker(app, pool="threads", concurrency=2, perform_ping_check=True):
        dead = reject_dead.delay()
        again = reject_once.delay()
        assert again.get(timeout=20) == "second delivery"
        wait_for(lambda: dead_letters(db, schema), 20, "the rejected message dead-lettered")
        wait_for(lambda: not messages(db, schema), 10, "the message table to empty")

    rows = runs(db, schema)
    assert [(r["task_id"], r["redelivered"]) for r in rows if r["label"] == "dead"] == [
        (dead.id, False)
    ]
    once = [r for r in rows if r["label"] == "once"]
    assert [(r["task_id"], r["redelivered"]) for r in once] == [(again.id, False), (again.id, True)]
    # requeued at once, not when the 10 s lease would have run out
    assert (once[1]["started_at"] - once[0]["finished_at"]).total_seconds() < 5
    assert [
        (d["task_id"], d["queue"], d["reason"], d["attempts"]) for d in dead_letters(db, schema)
    ] == [(dead.id, "celery", "rejected", 1)]


# -- 4. expires ----------------------------------------------------------------------


def test_expired_task_is_dropped_by_the_broker(app, ledger, db, schema):
    record = ledger_tasks(app, ledger)
    started, release = threading.Event(), threading.Event()
    hold = hold_task(app, ledger, started, release)
    # one slot, held until the task is done: the worker claims nothing while busy
    app.conf.task_acks_late = True
    app.conf.worker_prefetch_multiplier = 1

    expired = record.apply_async(("expired",), expires=1)
    (row,) = messages(db, schema)
    assert row["task_id"] == expired.id and row["expires_at"] is not None
    wait_for(lambda: past_expiry(db, schema, expired.id), 10, "the message to expire (no worker)")
    with start_worker(app, pool="threads", concurrency=1, perform_ping_check=True):
        try:
            assert record.delay("normal").get(timeout=20) == "normal"
            # gone from the table: the consumer's first sweep removed it
            wait_for(lambda: not messages(db, schema), 10, "the expired message to be removed")

            # and one that expires while the worker is busy: the next claim skips it
            busy = hold.delay()
            wait_for(started, 20, "the held task to start")
            late = record.apply_async(("late",), expires=1)
            wait_for(lambda: past_expiry(db, schema, late.id), 10, "the message to expire (busy)")
        finally:
            release.set()
        assert busy.get(timeout=20) == "held"
        assert record.delay("after").get(timeout=20) == "after"
        # never handed out; left for the next sweep (every 30 s)
        assert [(m["task_id"], m["attempts"], m["lease"]) for m in messages(db, schema)] == [
            (late.id, 0, None)
        ]

    assert labels(db, schema) == ["normal", "hold", "after"]
    # never delivered: a worker that had seen them would have stored REVOKED (expired)
    assert (expired.state, late.state) == ("PENDING", "PENDING")
    assert dead_letters(db, schema) == []


# -- 5. inspect active / reserved, revoke -------------------------------------------


def test_inspect_active_reserved_and_revoke(spawn, client, db, schema):
    name = "inspect@feat"
    w = spawn(name, concurrency=1, queues=None, prefetch=3)
    wait_for(lambda: w.says(" ready."), 30, "the worker ready", w)
    running = client.send_task("feat.block", ("running", "never")).id
    waiting = client.send_task("feat.record", ("waiting",)).id
    doomed = client.send_task("feat.record", ("doomed",)).id
    later = client.send_task("feat.record", ("later",)).id
    last = client.send_task("feat.record", ("last",)).id
    # the running task was acked as it started (no acks_late); prefetch 3 x concurrency 1
    # leaves three reserved in the worker and one in the table
    wait_for(
        lambda: (
            labels(db, schema) == ["running"]
            and [(m["task_id"], m["leased"]) for m in messages(db, schema)]
            == [(waiting, True), (doomed, True), (later, True), (last, False)]
        ),
        20,
        "the blocked task to run and three more to be reserved",
        w,
    )

    inspect = client.control.inspect(destination=[name], timeout=5)
    active = inspect.active()
    assert [(t["id"], t["name"], t["args"]) for t in active[name]] == [
        (running, "feat.block", ["running", "never"])
    ]
    reserved = inspect.reserved()
    # the worker keeps its reserved requests in a set: no order to compare
    assert sorted(t["id"] for t in reserved[name]) == sorted([waiting, doomed, later])

    client.control.revoke(doomed)
    client.control.revoke(running, terminate=True)
    wait_for(
        lambda: (
            {"waiting", "later", "last"} <= set(labels(db, schema)) and not messages(db, schema)
        ),
        20,
        "the remaining tasks to run once the running one is terminated",
        w,
    )

    rows = runs(db, schema)
    assert sorted(r["label"] for r in rows) == ["last", "later", "running", "waiting"]
    (cut,) = [r for r in rows if r["label"] == "running"]
    assert cut["finished_at"] is None  # terminated, never finished
    assert doomed not in {r["task_id"] for r in rows}
    assert set(inspect.revoked()[name]) >= {doomed, running}
    assert dead_letters(db, schema) == []
    assert w.proc.poll() is None


# -- 6. remote shutdown -------------------------------------------------------------


def test_remote_shutdown_stops_only_the_named_worker(spawn, client, db, schema):
    a = spawn("shut-a@feat", pool="threads", queues=None)
    b = spawn("shut-b@feat", pool="threads", queues=None)
    wait_for(lambda: a.says(" ready.") and b.says(" ready."), 30, "workers a and b ready", a, b)

    client.control.shutdown(destination=["shut-a@feat"])
    assert a.proc.wait(timeout=15) == 0, a.log()[-3000:]

    assert b.proc.poll() is None
    pong = client.control.inspect(timeout=2).ping()
    assert set(pong or {}) == {"shut-b@feat"}
    client.send_task("feat.record", ("after",))
    wait_for(lambda: runs(db, schema), 20, "a task on the remaining worker", b)
    assert [r["hostname"] for r in runs(db, schema)] == ["shut-b@feat"]
    assert "Traceback" not in a.log()


# -- 7. reply queues ------------------------------------------------------------------


def reply_queues(db: psycopg.Connection, schema: str) -> dict[str, list[str]]:
    """Reply-queue names found in the queue, binding and message tables."""
    found: dict[str, list[str]] = {}
    for table, column in (("queue", "name"), ("binding", "queue"), ("message_store", "queue")):
        query = sql.SQL("SELECT {c} FROM {t} WHERE {c} LIKE %s ORDER BY 1").format(
            c=sql.Identifier(column), t=sql.Identifier(schema, table)
        )
        found[table] = [row[0] for row in db.execute(query, (REPLY_QUEUES,))]
    return found


def record_reply_queue_writes(db: psycopg.Connection, schema: str) -> None:
    """From now on, copy every write of a reply queue's row in the queue table (name,
    expires, message_ttl) into ``reply_queue_writes``: what a watcher of the table
    would have seen while the queue existed, every time it changed."""
    db.execute(
        sql.SQL(
            """
            CREATE TABLE {s}.reply_queue_writes (name text, expires interval, ttl interval);
            CREATE FUNCTION {s}.record_reply_queue_write() RETURNS trigger
            LANGUAGE plpgsql AS $$
            BEGIN
                INSERT INTO {s}.reply_queue_writes VALUES (NEW.name, NEW.expires, NEW.message_ttl);
                RETURN NULL;
            END
            $$;
            CREATE TRIGGER record_reply_queue_write AFTER INSERT OR UPDATE ON {s}.queue
            FOR EACH ROW WHEN (NEW.name LIKE {pattern})
            EXECUTE FUNCTION {s}.record_reply_queue_write();
            """
        ).format(s=sql.Identifier(schema), pattern=sql.Literal(REPLY_QUEUES))
    )


def test_reply_queues_do_not_pile_up(app, dsn, schema, db):
    def fresh_app() -> Celery:
        # what each separate `celery inspect ping` is: a new mailbox, a new reply queue
        return celery_app(dsn, schema, main=f"client_{schema}", results=False)

    left: list[dict[str, list[str]]] = []
    with start_worker(app, pool="threads", concurrency=2, perform_ping_check=True) as w:
        record_reply_queue_writes(db, schema)
        for _ in range(3):
            assert w.hostname in (app.control.inspect(timeout=1).ping() or {})
            left.append(reply_queues(db, schema))
        for _ in range(3):
            client = fresh_app()
            try:
                assert w.hostname in (client.control.inspect(timeout=1).ping() or {})
            finally:
                client.close()
            left.append(reply_queues(db, schema))

    # the reply queues of the calls (each call binds a copy of the mailbox, whose oid,
    # and so queue name, is usually new) were declared with Celery's
    # control_queue_expires and control_queue_ttl: a client that dies mid-call leaves a
    # queue that the sweep removes...
    seen = _rows(db, "SELECT name, expires, ttl FROM {s}.reply_queue_writes", schema)
    assert seen
    assert {(r["expires"], r["ttl"]) for r in seen} == {
        (timedelta(seconds=10), timedelta(seconds=300))
    }, seen
    # ...and each call deleted its queue, bindings and replies when it was done
    assert left == [{"queue": [], "binding": [], "message_store": []}] * 6


# -- 8. pools -----------------------------------------------------------------------------


@pytest.mark.parametrize("pool", ["solo", "threads"])
def test_pool_round_trip(app, ledger, db, schema, pool):
    record = ledger_tasks(app, ledger)
    with start_worker(app, pool=pool, concurrency=2, perform_ping_check=True) as w:
        results = [record.delay(f"job{i}") for i in range(5)]
        assert [r.get(timeout=20) for r in results] == [f"job{i}" for i in range(5)]
        wait_for(lambda: not messages(db, schema), 10, "the acks")

    rows = runs(db, schema)
    assert sorted(r["task_id"] for r in rows) == sorted(r.id for r in results)
    module = {"solo": "celery.concurrency.solo", "threads": "celery.concurrency.thread"}
    assert type(w.pool).__module__ == module[pool]
    assert dead_letters(db, schema) == []


# -- 9. prefetch ---------------------------------------------------------------------------


def test_prefetch_multiplier_bounds_the_leases(app, ledger, db, schema):
    record = ledger_tasks(app, ledger)
    started, release = threading.Event(), threading.Event()
    hold = hold_task(app, ledger, started, release)
    # acks_late: the running task keeps its lease, so the window is running + reserved
    app.conf.task_acks_late = True
    app.conf.worker_prefetch_multiplier = 2
    # all six wait before the worker starts: its first claim could take them all
    held = hold.delay()
    rest = [record.delay(f"job{i}") for i in range(5)]
    with start_worker(app, pool="threads", concurrency=1, perform_ping_check=False):
        try:
            wait_for(started, 20, "the held task to start")
            leased: list[int] = []

            def window() -> int:
                rows = messages(db, schema)
                assert len(rows) == 6, rows  # nothing acked while the only slot is busy
                leased.append(sum(m["leased"] for m in rows))
                return leased[-1]

            wait_for(lambda: window() == 2, 10, "the running task and one more leased")
            # no event says that a consumer claims no more: the window is watched for 2 s
            wait_for(lambda: window() > 2, 2, "a third lease while the slot is busy", never=True)
            assert labels(db, schema) == ["hold"]
        finally:
            release.set()
        assert held.get(timeout=20) == "held"
        assert [r.get(timeout=20) for r in rest] == [f"job{i}" for i in range(5)]

    # concurrency 1 x multiplier 2: the running task and one more, never a third
    assert max(leased) == 2 and leased[-1] == 2, leased
    assert sorted(labels(db, schema)) == ["hold"] + [f"job{i}" for i in range(5)]
