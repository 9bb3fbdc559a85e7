"""confirm_publish=False: publishes sent on a pipelined connection without waiting.

The message table is locked (EXCLUSIVE: reads go on, inserts wait) where a test must
see that a publish returned before its statement ran: a publish that waited for its
answer would hang there.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest
from helpers import counter
from kombu import Connection, Consumer, Exchange, Producer, Queue
from psycopg import sql
from waiting import wait_for

import kombu_pgqueue
from kombu_pgqueue import _pipelined
from kombu_pgqueue.exceptions import ConfigurationError

UNCONFIRMED = {"confirm_publish": False}


@contextmanager
def _inserts_wait(dsn: str, schema: str) -> Iterator[None]:
    """Inserts into the message table wait until the block ends (reads do not)."""
    holder = psycopg.connect(dsn)
    try:
        table = sql.Identifier(schema, "message_store")
        holder.execute(sql.SQL("LOCK TABLE {} IN EXCLUSIVE MODE").format(table))
        yield
        holder.rollback()
    finally:
        holder.close()


@pytest.fixture(autouse=True)
def _close_pipelines() -> Iterator[None]:
    """Each test's schema is dropped after it: so are the pipelines made for it."""
    yield
    _pipelined._close_all()


def _pipeline(conn: Connection) -> _pipelined.Pipeline:
    found = _pipelined.pipeline(conn.default_channel.store)
    assert found.backend_pid is not None, "nothing was published unconfirmed"
    return found


def _waiting_on_a_lock(db: psycopg.Connection, pid: int) -> bool:
    row = db.execute(
        "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", (pid,)
    ).fetchone()
    return row is not None and row[0] == "Lock"


def _gone(db: psycopg.Connection, pid: int) -> bool:
    return db.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone() is None


def _end_session(db: psycopg.Connection, pid: int) -> None:
    """Terminate the pipelined session ``pid`` and wait until it is gone."""
    db.execute("SELECT pg_terminate_backend(%s)", (pid,))
    wait_for(lambda: _gone(db, pid), 10, "the pipelined session to end")


def _bodies(db: psycopg.Connection, schema: str, queue: str) -> list[Any]:
    query = sql.SQL("SELECT body FROM {} WHERE queue = %s ORDER BY id").format(
        sql.Identifier(schema, "message_store")
    )
    return [json.loads(bytes(row[0])) for row in db.execute(query, (queue,))]


def test_unconfirmed_publishes_all_arrive_in_order_at_a_consumer(
    make_connection: Callable[..., Connection],
) -> None:
    publisher, reader = make_connection(**UNCONFIRMED), make_connection()
    queue = Queue("uc_order", Exchange("uc_x", "direct"), "run")
    got: list[int] = []
    Consumer(
        reader, [queue], callbacks=[lambda body, m: (got.append(body["n"]), m.ack())]
    ).consume()
    producer = Producer(publisher)
    for n in range(150):  # through the exchange (publish_routed) ...
        producer.publish({"n": n}, exchange="uc_x", routing_key="run")
    for n in range(150, 300):  # ... and to the queue by name (publish)
        producer.publish({"n": n}, routing_key="uc_order")
    # the last answer at least is still unread: nothing waited for it
    assert _pipeline(publisher).in_flight >= 1

    while len(got) < 300:
        reader.drain_events(timeout=10)  # socket.timeout: a message did not come

    assert got == list(range(300))


def test_publishes_return_before_their_statements_run_and_flush_waits_for_all(
    make_connection: Callable[..., Connection], dsn: str, schema: str, db: psycopg.Connection
) -> None:
    publisher = make_connection(**UNCONFIRMED)
    producer = Producer(publisher)
    producer.publish({"n": -1}, routing_key="uc_flush", declare=[Queue("uc_flush")])
    publisher.transport.flush_publishes()
    pipeline = _pipeline(publisher)
    pid = pipeline.backend_pid
    assert pid is not None
    flushed = threading.Event()
    with _inserts_wait(dsn, schema):
        for n in range(20):
            producer.publish({"n": n}, routing_key="uc_flush")
        assert pipeline.in_flight == 20
        assert _bodies(db, schema, "uc_flush") == [{"n": -1}]
        flusher = threading.Thread(
            target=lambda: (publisher.transport.flush_publishes(), flushed.set())
        )
        flusher.start()
        wait_for(lambda: _waiting_on_a_lock(db, pid), 10, "the first publish to wait")
        wait_for(flushed, 0.5, "flush to return while the publishes wait", never=True)
    wait_for(flushed, 30, "flush to return once the publishes ran")
    flusher.join()

    assert pipeline.in_flight == 0
    assert _bodies(db, schema, "uc_flush") == [{"n": n} for n in range(-1, 20)]


def test_a_failed_statement_is_logged_and_counted_and_the_next_publishes_go_on(
    make_connection: Callable[..., Connection],
    db: psycopg.Connection,
    schema: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    publisher = make_connection(**UNCONFIRMED)
    producer = Producer(publisher)
    Queue("uc_good")(publisher.default_channel).declare()
    publisher.default_channel.exchange_declare("uc_bad", "topic")
    # a binding whose pattern PostgreSQL cannot compile: routing through it fails
    db.execute(
        sql.SQL(
            "INSERT INTO {} (exchange, routing_key, queue, pattern) VALUES (%s, %s, %s, %s)"
        ).format(sql.Identifier(schema, "binding")),
        ("uc_bad", "(", "uc_good", "("),
    )
    failed = counter("publish_failed")

    with caplog.at_level(logging.ERROR, logger="kombu_pgqueue._pipelined"):
        producer.publish({"n": 0}, routing_key="uc_good")
        producer.publish({"n": 1}, exchange="uc_bad", routing_key="a.b")
        producer.publish({"n": 2}, routing_key="uc_good")
        publisher.transport.flush_publishes()
        producer.publish({"n": 3}, routing_key="uc_good")
        publisher.transport.flush_publishes()

    assert counter("publish_failed") == failed + 1
    [record] = [r for r in caplog.records if "was not stored" in r.getMessage()]
    assert "exchange 'uc_bad'" in record.getMessage()
    assert "regular expression" in record.getMessage()
    assert _bodies(db, schema, "uc_good") == [{"n": 0}, {"n": 2}, {"n": 3}]


def test_a_lost_connection_raises_at_the_next_publish_and_publishing_goes_on(
    make_connection: Callable[..., Connection],
    dsn: str,
    db: psycopg.Connection,
    schema: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    publisher = make_connection(**UNCONFIRMED)
    producer = Producer(publisher)
    producer.publish({"n": 0}, routing_key="uc_lost", declare=[Queue("uc_lost")])
    publisher.transport.flush_publishes()
    pid = _pipeline(publisher).backend_pid
    assert pid is not None
    lost = counter("publish_lost", "uc_lost")

    with caplog.at_level(logging.ERROR, logger="kombu_pgqueue._pipelined"):
        with _inserts_wait(dsn, schema):
            for n in range(1, 4):
                producer.publish({"n": n}, routing_key="uc_lost")
            wait_for(lambda: _waiting_on_a_lock(db, pid), 10, "the publishes to wait")
            _end_session(db, pid)
        with pytest.raises(publisher.transport.connection_errors):
            producer.publish({"n": 4}, routing_key="uc_lost", retry=False)

    assert counter("publish_lost", "uc_lost") == lost + 3
    assert any("3 of them unanswered" in r.getMessage() for r in caplog.records)
    producer.publish({"n": 5}, routing_key="uc_lost", retry=False)
    publisher.transport.flush_publishes()
    assert _pipeline(publisher).backend_pid != pid
    assert _bodies(db, schema, "uc_lost") == [{"n": 0}, {"n": 5}]


def test_kombus_retry_policy_resends_a_publish_that_met_a_lost_connection(
    make_connection: Callable[..., Connection], db: psycopg.Connection, schema: str
) -> None:
    publisher = make_connection(**UNCONFIRMED)
    producer = Producer(publisher)
    producer.publish({"n": 0}, routing_key="uc_retry", declare=[Queue("uc_retry")])
    publisher.transport.flush_publishes()
    pid = _pipeline(publisher).backend_pid
    _end_session(db, pid)

    producer.publish({"n": 1}, routing_key="uc_retry", retry=True, retry_policy={"max_retries": 2})
    publisher.transport.flush_publishes()

    assert _bodies(db, schema, "uc_retry") == [{"n": 0}, {"n": 1}]


def test_a_forked_child_publishes_on_its_own_connection(
    make_connection: Callable[..., Connection], db: psycopg.Connection, schema: str
) -> None:
    publisher = make_connection(**UNCONFIRMED)
    producer = Producer(publisher)
    producer.publish({"n": "parent"}, routing_key="uc_fork", declare=[Queue("uc_fork")])
    publisher.transport.flush_publishes()
    parent_pid = _pipeline(publisher).backend_pid
    read, write = os.pipe()

    child = os.fork()
    if child == 0:  # pragma: no cover - the child reports through the pipe
        try:
            producer.publish({"n": "child"}, routing_key="uc_fork")
            publisher.transport.flush_publishes()
            answer = str(_pipeline(publisher).backend_pid)
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            answer = repr(exc)
        os.write(write, answer.encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        answer = pipe.read()
    os.waitpid(child, 0)

    assert answer.isdigit(), answer
    assert int(answer) != parent_pid
    # the parent's session outlived the child, and still publishes
    assert not _gone(db, parent_pid)
    producer.publish({"n": "parent again"}, routing_key="uc_fork")
    publisher.transport.flush_publishes()
    assert _pipeline(publisher).backend_pid == parent_pid
    assert _bodies(db, schema, "uc_fork") == [
        {"n": "parent"},
        {"n": "child"},
        {"n": "parent again"},
    ]


def test_enlisted_publishes_go_in_the_applications_transaction(
    make_connection: Callable[..., Connection], dsn: str, db: psycopg.Connection, schema: str
) -> None:
    publisher = make_connection(**UNCONFIRMED)
    producer = Producer(publisher)
    Queue("uc_tx")(publisher.default_channel).declare()
    with psycopg.connect(dsn) as app_conn:
        with app_conn.transaction(), kombu_pgqueue.transaction(app_conn):
            producer.publish({"n": 1}, routing_key="uc_tx")
            assert _bodies(db, schema, "uc_tx") == []  # not committed yet
        with pytest.raises(ZeroDivisionError), app_conn.transaction():
            with kombu_pgqueue.transaction(app_conn):
                producer.publish({"n": 2}, routing_key="uc_tx")
            1 / 0  # noqa: B018 - rolls the transaction back

    assert _bodies(db, schema, "uc_tx") == [{"n": 1}]
    # nothing of it went the unconfirmed way
    assert _pipelined.pipeline(publisher.default_channel.store).backend_pid is None


def test_an_unroutable_publish_is_reported_when_its_answer_is_read(
    make_connection: Callable[..., Connection], caplog: pytest.LogCaptureFixture
) -> None:
    publisher = make_connection(**UNCONFIRMED)
    publisher.default_channel.exchange_declare("uc_nowhere", "direct")
    unroutable = counter("unroutable")
    with caplog.at_level(logging.WARNING, logger="kombu_pgqueue._unroutable"):
        Producer(publisher).publish({"n": 1}, exchange="uc_nowhere", routing_key="none")
        assert counter("unroutable") == unroutable
        publisher.transport.flush_publishes()

    assert counter("unroutable") == unroutable + 1
    assert any("uc_nowhere" in r.getMessage() for r in caplog.records)


def test_unconfirmed_publishes_cannot_raise_unroutable(
    broker_base_url: str, transport_options: dict[str, object]
) -> None:
    options = {**transport_options, **UNCONFIRMED, "unroutable": "raise"}
    with pytest.raises(ConfigurationError, match="'confirm_publish'.*'unroutable'"):
        Connection(broker_base_url, transport_options=options).connect()
