"""Idempotent publishing: dedup keys (explicit, or a Celery task publish call's own).

A key is held while its message waits or is leased by a consumer; the ack frees it.
Celery tests count executions in the worker, with a sentinel task sent last: once
the sentinel has run, anything queued before it has run too.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from typing import Any

import celery.contrib.testing.tasks  # noqa: F401 - registers celery.ping
import psycopg
import pytest
from celery import Celery
from celery.contrib.testing.worker import start_worker
from kombu import Connection, Exchange, Producer, Queue
from psycopg import sql
from tx_helpers import make_app
from waiting import wait_for
from wire_faults import FaultProxy

QUEUE = "dd"


def _task_id() -> str:
    """A task id to send more than once. Never a constant: Celery's result tables are
    shared by every test (and every run) on the database, and two rows of one id from
    different tests or runs collide in celery_taskmeta (IntegrityError, or another
    Celery version's pickle read back)."""
    return f"dd-{uuid.uuid4().hex}"


def _get(connection: Connection, queue: str = QUEUE) -> Any:
    """Claim one message (leased until acked), or fail."""
    message = Queue(queue, channel=connection.default_channel).get(no_ack=False)
    assert message is not None, f"no message in {queue!r}"
    return message


def _recorder(app: Celery) -> tuple[Any, list[str]]:
    ran: list[str] = []

    # ignore_result: the tests count runs, and the runs of one task id would store
    # their results at once (two INSERTs of one task_id: an IntegrityError). send_task
    # says it again: Celery 5.6 sends ignore_result=False with a task sent by name,
    # and the worker takes the message's word over the task's
    @app.task(name="dd.record", shared=False, ignore_result=True)
    def record(label: str) -> None:
        ran.append(label)

    return record, ran


def _run_until_sentinel(app: Celery, record: Any, ran: list[str]) -> None:
    """Start a worker, send a sentinel, and return once it ran."""
    with start_worker(app, pool="threads", perform_ping_check=False):
        record.apply_async(("sentinel",), queue="celery")
        wait_for(lambda: "sentinel" in ran, 20, "the sentinel task")


def _argsreprs(rows: Callable[..., list[tuple[Any, ...]]]) -> list[str]:
    return [headers["argsrepr"] for (headers,) in rows("headers")]


# -- Kombu ------------------------------------------------------------------------------


def test_publish_same_dedup_key_stores_one_message(connection, rows):
    producer = Producer(connection)
    producer.publish({"n": 1}, routing_key=QUEUE, dedup_key="k")
    producer.publish({"n": 2}, routing_key=QUEUE, dedup_key="k")
    # the key may also come as a header
    producer.publish({"n": 3}, routing_key=QUEUE, headers={"dedup_key": "k"})
    # keys are per queue, and a message without one is never a duplicate
    producer.publish({"n": 4}, routing_key="dd_other", dedup_key="k")
    producer.publish({"n": 5}, routing_key=QUEUE)
    producer.publish({"n": 6}, routing_key=QUEUE)
    assert rows("queue, dedup_key") == [
        (QUEUE, "k"),
        ("dd_other", "k"),
        (QUEUE, None),
        (QUEUE, None),
    ]
    assert _get(connection).payload == {"n": 1}


def test_ack_frees_the_dedup_key(connection, rows):
    producer = Producer(connection)
    producer.publish({"n": 1}, routing_key=QUEUE, dedup_key="k")
    _get(connection).ack()
    assert rows() == []
    producer.publish({"n": 2}, routing_key=QUEUE, dedup_key="k")
    message = _get(connection)
    assert message.payload == {"n": 2}
    message.ack()
    assert rows() == []


def _leave_by_reject(connection: Connection) -> None:
    _get(connection).reject()  # into the dead letters


def _leave_by_purge(connection: Connection) -> None:
    assert connection.default_channel.queue_purge(QUEUE) == 1


def _leave_by_no_ack_get(connection: Connection) -> None:
    assert Queue(QUEUE, channel=connection.default_channel).get(no_ack=True) is not None


def _keys(db: psycopg.Connection, schema: str) -> list[tuple[Any, ...]]:
    """The keys held (table dedup): a message's key goes with it, or the table would
    keep one row for every keyed message ever sent (every Celery task)."""
    query = sql.SQL("SELECT queue, dedup_key FROM {}.dedup ORDER BY 1, 2")
    return db.execute(query.format(sql.Identifier(schema))).fetchall()


@pytest.mark.parametrize("leave", [_leave_by_reject, _leave_by_purge, _leave_by_no_ack_get])
def test_every_way_a_message_leaves_frees_its_dedup_key(connection, rows, db, schema, leave):
    producer = Producer(connection)
    producer.publish({"n": 1}, routing_key=QUEUE, dedup_key="k")
    assert _keys(db, schema) == [(QUEUE, "k")]
    leave(connection)
    assert rows() == []
    assert _keys(db, schema) == []
    producer.publish({"n": 2}, routing_key=QUEUE, dedup_key="k")
    assert [bytes(body) for (body,) in rows("body")] == [b'{"n": 2}']


def test_batched_acks_free_the_keys_of_the_keyed_messages_among_them(
    make_connection, rows, db, schema
):
    """The default acks: one statement for whatever was acked meanwhile (ack_many),
    keyed messages and others together."""
    connection = make_connection(batch_acks=True)
    producer = Producer(connection)
    producer.publish({"n": 1}, routing_key=QUEUE, dedup_key="k")
    producer.publish({"n": 0}, routing_key=QUEUE)
    first, second = _get(connection), _get(connection)
    first.ack()
    second.ack()
    wait_for(lambda: rows() == [], 10, "the batched acks")
    assert _keys(db, schema) == []
    producer.publish({"n": 2}, routing_key=QUEUE, dedup_key="k")
    assert [bytes(body) for (body,) in rows("body")] == [b'{"n": 2}']


def test_leased_message_still_holds_its_dedup_key(connection, store, rows):
    producer = Producer(connection)
    producer.publish({"n": 1}, routing_key=QUEUE, dedup_key="k")
    held = _get(connection)
    assert store.size(QUEUE) == 0  # leased, not waiting
    producer.publish({"n": 2}, routing_key=QUEUE, dedup_key="k")
    producer.publish({"n": 3}, routing_key=QUEUE, dedup_key="k", dedup_replace=True)
    assert [bytes(body) for (body,) in rows("body")] == [b'{"n": 1}']
    assert store.size(QUEUE) == 0
    held.ack()
    producer.publish({"n": 4}, routing_key=QUEUE, dedup_key="k")
    assert _get(connection).payload == {"n": 4}


def test_dedup_replace_overwrites_a_waiting_message(connection, rows):
    producer = Producer(connection)
    producer.publish({"n": 1}, routing_key=QUEUE, dedup_key="k", priority=1)
    producer.publish({"n": 2}, routing_key=QUEUE, dedup_key="k", dedup_replace=True, priority=7)
    assert [(bytes(b), p) for b, p in rows("body, priority")] == [(b'{"n": 2}', 7)]
    message = _get(connection)
    assert message.payload == {"n": 2}
    message.ack()
    assert rows() == []


def test_dedup_key_through_a_named_exchange(connection, rows):
    """Documented for any message: also one published to a bound exchange."""
    channel = connection.default_channel
    exchange = Exchange("dd_exchange", "direct")
    Queue(QUEUE, exchange, routing_key="rk", channel=channel).declare()
    producer = Producer(connection, exchange=exchange)
    producer.publish({"n": 1}, routing_key="rk", dedup_key="k")
    producer.publish({"n": 2}, routing_key="rk", dedup_key="k")
    assert rows("queue, dedup_key") == [(QUEUE, "k")]


def test_each_publish_call_of_a_task_id_is_queued(make_connection, rows):
    """Only a retry of one publish call is a duplicate: the same task id published again
    (Task.replace, chord bodies, apply_async(task_id=...) twice) is a message Celery meant
    to send."""
    headers = {"task": "dd.record", "id": "same-id", "retries": 0}
    on = make_connection()
    off = make_connection(dedup_task_ids=False)
    for conn in (on, on, off, off):
        Producer(conn).publish({"n": 1}, routing_key=QUEUE, headers=headers)
    keys = [key for (key,) in rows("dedup_key")]
    assert len(keys) == 4
    assert keys[0].startswith("celery:same-id:") and keys[1].startswith("celery:same-id:")
    assert keys[0] != keys[1]
    # without the option the messages carry no key
    assert keys[2:] == [None, None]
    # the call's id is the transport's own: consumers do not see it
    message = _get(on)
    assert "pgqueue_publish_id" not in message.properties
    # an explicit key still works with the option off
    Producer(off).publish({"n": 2}, routing_key=QUEUE, dedup_key="x")
    Producer(off).publish({"n": 3}, routing_key=QUEUE, dedup_key="x")
    assert rows("dedup_key", "dedup_key = 'x'") == [("x",)]


@pytest.mark.parametrize("dedup_task_ids", [True, False])
def test_publish_retried_after_its_commit_is_queued_once(
    rows, dsn, url_with, transport_options, dedup_task_ids
):
    """Kombu's publish retry after a connection broke between the commit and its answer.

    The proxy closes the connection once the server has committed the INSERT; Kombu
    reconnects and sends the same publish call again. With dedup_task_ids that retry is
    recognised; without it the task is queued twice (the fault is real).
    """
    proxy = FaultProxy(dsn)
    # the proxy listens on TCP, whether the server is reached by TCP or a socket
    options = {**transport_options, "sslmode": "disable", "gssencmode": "disable"}
    conn = Connection(
        url_with(host="127.0.0.1", port=str(proxy.port)),
        transport_options={**options, "dedup_task_ids": dedup_task_ids},
    )
    try:
        conn.connect()
        producer = Producer(conn)
        producer.publish({"n": 0}, routing_key=QUEUE)  # connected, schema in place
        proxy.cut_after_commit()
        producer.publish(
            {"n": 1},
            routing_key=QUEUE,
            headers={"task": "dd.record", "id": "retried-id"},
            retry=True,
            retry_policy={"max_retries": 3, "interval_start": 0, "interval_step": 0},
        )
        assert proxy.cuts == 1
        copies = rows("body", "body = %s", b'{"n": 1}')
        assert len(copies) == (1 if dedup_task_ids else 2)
    finally:
        conn.release()
        proxy.close()


# -- Celery ------------------------------------------------------------------------------


def test_celery_dedup_key_runs_once(app, connection, rows):
    record, ran = _recorder(app)
    record.apply_async(("first",), dedup_key="k")
    record.apply_async(("second",), dedup_key="k")
    assert _argsreprs(rows) == ["('first',)"]
    _run_until_sentinel(app, record, ran)
    assert ran == ["first", "sentinel"]


def test_celery_dedup_replace_runs_the_new_args_only(app, connection, rows):
    record, ran = _recorder(app)
    old = record.apply_async(("old",), dedup_key="k")
    new = record.apply_async(("new",), dedup_key="k", dedup_replace=True)
    assert [(h["argsrepr"], h["id"]) for (h,) in rows("headers")] == [("('new',)", new.id)]
    assert old.id != new.id
    _run_until_sentinel(app, record, ran)
    assert ran == ["new", "sentinel"]


def test_celery_dedup_replace_leaves_a_running_message(app, connection, rows):
    started = threading.Event()
    gate = threading.Event()
    ran: list[str] = []

    # acks_late: the message stays leased (and its key held) while the task runs
    @app.task(name="dd.hold", shared=False, acks_late=True, ignore_result=True)
    def hold(label: str) -> None:
        started.set()
        gate.wait(20)
        ran.append(label)

    with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False):
        hold.apply_async(("running",), dedup_key="k")
        assert started.wait(15)
        hold.apply_async(("replacement",), dedup_key="k", dedup_replace=True)
        hold.apply_async(("duplicate",), dedup_key="k")
        assert _argsreprs(rows) == ["('running',)"]
        gate.set()
        wait_for(lambda: ran == ["running"], 15, "the running task to finish")
        hold.apply_async(("sentinel",))
        wait_for(lambda: "sentinel" in ran, 15, "the sentinel task")
    assert ran == ["running", "sentinel"]


def test_celery_task_id_dedup_ends_at_the_early_ack(app, connection, rows):
    """transport.py: with Celery's default (early) acks the row, and so its key, is gone
    once the task starts; a publish of the same id after that is queued (documented)."""
    started = threading.Event()
    gate = threading.Event()
    ran: list[str] = []

    task_id = _task_id()

    # ignore_result: both runs of the id finish together when the gate opens
    @app.task(name="dd.hold", shared=False, ignore_result=True)
    def hold(label: str) -> None:
        started.set()
        gate.wait(20)
        ran.append(label)

    with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False):
        app.send_task("dd.hold", ("first",), task_id=task_id, ignore_result=True)
        assert started.wait(15)
        # Celery acks before running (acks_late=False): once that ack is written, the
        # table no longer holds the running task's key
        wait_for(lambda: rows() == [], 10, "the early ack")
        # the publish is retried while the task runs
        app.send_task("dd.hold", ("retried publish",), task_id=task_id, ignore_result=True)
        gate.set()
        wait_for(lambda: "first" in ran, 15, "the running task to finish")
        hold.apply_async(("sentinel",))
        wait_for(lambda: "sentinel" in ran, 15, "the sentinel task")
    assert sorted(ran) == ["first", "retried publish", "sentinel"]
    assert app.AsyncResult(task_id).state == "PENDING"  # no result row written


def test_celery_same_task_id_sent_twice_runs_twice(app, connection, rows):
    """apply_async(task_id=...) twice is two sends Celery meant (not a publish retry)."""
    record, ran = _recorder(app)
    task_id = _task_id()
    first = app.send_task("dd.record", ("twice",), task_id=task_id, ignore_result=True)
    again = app.send_task("dd.record", ("twice",), task_id=task_id, ignore_result=True)
    assert first.id == again.id == task_id
    assert len(rows()) == 2
    _run_until_sentinel(app, record, ran)
    assert sorted(ran) == ["sentinel", "twice", "twice"]
    # neither run wrote a result: two at once would race for one celery_taskmeta row
    assert app.AsyncResult(task_id).state == "PENDING"


def test_celery_task_id_sent_twice_through_a_named_exchange(app, connection, rows):
    exchange = Exchange("dd_tasks", "direct")
    Queue(QUEUE, exchange, routing_key="dd.key", channel=connection.default_channel).declare()
    task_id = _task_id()
    for _ in range(2):
        app.send_task(
            "dd.record",
            ("twice",),
            task_id=task_id,
            ignore_result=True,
            exchange=exchange,
            routing_key="dd.key",
        )
    assert [queue for (queue,) in rows("queue")] == [QUEUE, QUEUE]


@pytest.mark.parametrize("acks_late", [False, True])
def test_task_replace_delivers_the_replacement(celery_dsn, schema, acks_late):
    """Task.replace() sends the replacement under the replaced task's id while that
    task's message is still in the table (acks_late: leased; early acks: the batched
    ack may not have been written yet). It must run: dedup once dropped it."""
    app = make_app(celery_dsn, schema)
    try:

        @app.task(name="dd.countdown", shared=False, bind=True, acks_late=acks_late)
        def countdown(self: Any, n: int, seen: list[int] | None = None) -> list[int]:
            seen = [*(seen or []), n]
            if n == 0:
                return seen
            raise self.replace(countdown.s(n - 1, seen))

        with start_worker(app, pool="solo", perform_ping_check=False):
            result = countdown.delay(2)
            assert result.get(timeout=30) == [2, 1, 0]
    finally:
        app.close()


@pytest.mark.parametrize("acks_late", [False, True])
def test_celery_task_retry_is_not_blocked_by_its_own_key(app, connection, acks_late):
    attempts: list[int] = []
    done = threading.Event()

    @app.task(
        name="dd.flaky",
        shared=False,
        bind=True,
        acks_late=acks_late,
        autoretry_for=(KeyError,),
        retry_backoff=0.05,
        retry_jitter=False,
        max_retries=3,
    )
    def flaky(self: Any) -> int:
        attempts.append(self.request.retries)
        if self.request.retries < 2:
            raise KeyError("again")
        done.set()
        return self.request.retries

    with start_worker(app, pool="threads", perform_ping_check=False):
        flaky.delay()
        assert done.wait(30), f"the task did not complete; attempts: {attempts}"
    assert attempts == [0, 1, 2]


def test_dedup_task_ids_false_stores_both_copies(celery_dsn, schema, connection, rows):
    app = make_app(celery_dsn, schema, dedup_task_ids=False)
    try:
        record, ran = _recorder(app)
        task_id = _task_id()
        app.send_task("dd.record", ("twice",), task_id=task_id, ignore_result=True)
        app.send_task("dd.record", ("twice",), task_id=task_id, ignore_result=True)
        assert rows("dedup_key") == [(None,), (None,)]
        _run_until_sentinel(app, record, ran)
        assert sorted(ran) == ["sentinel", "twice", "twice"]
    finally:
        app.close()
