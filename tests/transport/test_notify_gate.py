"""Publishes notify only queues that a consumer waits for.

A NOTIFY costs every listening session of the database a wakeup at each commit, and its
commit holds the cluster's notify lock across the WAL flush: a publish to a queue that
nobody consumes must not send one. A consumer that starts while a publish is committing
must still get that message without waiting for the safety poll.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import psycopg
import pytest
from kombu import Connection, Consumer, Exchange, Producer, Queue
from psycopg import sql

from kombu_pgqueue import admin, bulk
from kombu_pgqueue._listener import queue_token
from kombu_pgqueue._sql import queries
from tests.waiting import wait_for

SENTINEL = "sentinel"


@pytest.fixture
def observer(connection: Connection, dsn: str) -> Iterator[psycopg.Connection]:
    """A session that LISTENs on the broker's channel, as a worker's listener does."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL("LISTEN {}").format(sql.Identifier(connection.transport.options.channel))
        )
        yield conn


def _sent(observer: psycopg.Connection, connection: Connection) -> list[str]:
    """What was notified so far: a sentinel NOTIFY from another session marks the end
    (notifications arrive in commit order)."""
    channel = connection.transport.options.channel
    with psycopg.connect(observer.info.dsn, autocommit=True) as other:
        other.execute("SELECT pg_notify(%s, %s)", [channel, SENTINEL])
    payloads: list[str] = []
    for notify in observer.notifies(timeout=10):
        if notify.payload == SENTINEL:
            return payloads
        payloads.append(notify.payload)
    raise AssertionError(f"the sentinel did not arrive; got {payloads}")


def _token(queue: str) -> str:
    return "r:" + queue_token(queue)


def _tokens(payloads: list[str]) -> list[str]:
    """The queue part of each notification: ``r:<token>``, whether it is addressed to one
    consumer (``r:<token>:<consumer>``) or to every consumer of the queue."""
    return [":".join(p.split(":")[:2]) for p in payloads]


def test_a_publish_to_a_queue_nobody_consumes_notifies_nobody(
    connection: Connection, observer: psycopg.Connection
) -> None:
    Exchange("fan", "fanout")(connection.default_channel).declare()
    Queue("routed", Exchange("fan", "fanout"))(connection.default_channel).declare()
    producer = Producer(connection)

    producer.publish("direct", routing_key="unwatched")
    producer.publish("routed", exchange="fan", routing_key="")
    bulk.publish_many(connection, ["a", "b"], routing_key="unwatched")

    assert _sent(observer, connection) == []


def test_a_publish_to_a_consumed_queue_notifies_until_the_consumer_cancels(
    connection: Connection, make_connection, observer: psycopg.Connection
) -> None:
    Exchange("fan", "fanout")(connection.default_channel).declare()
    Queue("routed", Exchange("fan", "fanout"))(connection.default_channel).declare()
    worker = make_connection()
    producer = Producer(connection)
    with Consumer(worker, [Queue("watched"), Queue("routed")], callbacks=[]):
        producer.publish("direct", routing_key="watched")
        producer.publish("routed", exchange="fan", routing_key="")
        producer.publish("not this one", routing_key="other")
        bulk.publish_many(connection, ["a", "b"], routing_key="watched")
        assert _tokens(_sent(observer, connection)) == [
            _token("watched"),
            _token("routed"),
            _token("watched"),
        ]
    producer.publish("after the cancel", routing_key="watched")
    assert _sent(observer, connection) == []


def test_a_consumer_that_starts_while_a_publish_commits_gets_it_without_polling(
    make_connection, dsn: str, schema: str
) -> None:
    """The publish looked for a waiting consumer before the consumer started waiting,
    and commits after it: the consumer's first claim must wait for that commit."""
    worker = make_connection(polling_interval=3600)
    channel = worker.transport.options.channel
    publish = queries(schema)["publish"]
    got: list[object] = []
    with psycopg.connect(dsn) as publisher:  # a transaction, open until commit()
        publisher.execute(
            publish,
            {
                "queue": "late",
                "priority": 0,
                "eta": None,
                "expires_at": None,
                "dedup_key": None,
                "body": b'"in flight"',
                "content_type": "application/json",
                "content_encoding": "utf-8",
                "headers": "{}",
                "properties": "{}",
                "replace": False,
                "channel": channel,
                "gate": True,
            },
        )
        consumer = Consumer(
            worker, [Queue("late")], callbacks=[lambda body, m: (got.append(body), m.ack())]
        )
        started = threading.Thread(target=consumer.consume)
        started.start()
        with psycopg.connect(dsn, autocommit=True) as watcher:
            # the consumer waits for the publish's commit
            wait_for(
                lambda: watcher.execute(
                    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'"
                    " AND classid = 1885827408 AND NOT granted"
                ).fetchone()[0],  # type: ignore[index]
                timeout=10,
                what="the consumer waiting for the publish in flight",
            )
        publisher.commit()
        started.join(timeout=10)
    worker.drain_events(timeout=10)
    consumer.cancel()
    assert got == ["in flight"]


def test_a_consumer_with_a_backlog_is_not_notified_until_it_has_drained_the_queue(
    connection: Connection, make_connection, observer: psycopg.Connection
) -> None:
    producer = Producer(connection)
    for i in range(10):
        producer.publish(i, routing_key="busy")
    worker = make_connection()
    got: list[object] = []
    with Consumer(
        worker, [Queue("busy")], callbacks=[lambda body, m: (got.append(body), m.ack())]
    ) as consumer:
        consumer.qos(prefetch_count=4)
        worker.drain_events(timeout=5)  # a full batch: more is waiting
        producer.publish("while busy", routing_key="busy")
        assert _sent(observer, connection) == []

        while len(got) < 11:
            worker.drain_events(timeout=5)
        producer.publish("once drained", routing_key="busy")
        assert _tokens(_sent(observer, connection)) == [_token("busy")]
        worker.drain_events(timeout=5)
    assert got == [*range(10), "while busy", "once drained"]


def test_a_publish_wakes_one_of_the_waiting_consumers_not_all(
    connection: Connection,
    make_connection,
    observer: psycopg.Connection,
    db: psycopg.Connection,
    schema: str,
) -> None:
    """Every idle worker of a queue used to claim at each publish, and all but one found
    nothing: with hundreds of workers, hundreds of claims per message."""
    workers = [make_connection(polling_interval=3600) for _ in range(3)]
    got: list[object] = []
    consumers = [
        Consumer(w, [Queue("shared")], callbacks=[lambda body, m: (got.append(body), m.ack())])
        for w in workers
    ]
    for consumer in consumers:
        consumer.consume()
    for worker in workers:  # each has claimed once (nothing there) and waits
        with contextlib.suppress(TimeoutError):
            worker.drain_events(timeout=0.1)
    waiting = {
        row[0]
        for row in db.execute(
            sql.SQL("SELECT consumer FROM {}.waiter WHERE queue = 'shared'").format(
                sql.Identifier(schema)
            )
        )
    }
    assert len(waiting) == 3
    empty_before = admin.counters().get(("empty_claims", "shared"), 0)

    producer = Producer(connection)
    for i in range(6):
        producer.publish(i, routing_key="shared")
        (payload,) = _sent(observer, connection)
        assert payload.startswith(_token("shared") + ":")
        assert payload.rsplit(":", 1)[1] in waiting  # addressed to one of them
        for worker in workers:  # only the one addressed claims, and gets it
            with contextlib.suppress(TimeoutError):
                worker.drain_events(timeout=0.1)
        assert got == list(range(i + 1))

    assert admin.counters().get(("empty_claims", "shared"), 0) == empty_before
    for consumer in consumers:
        consumer.cancel()


def test_a_waiter_whose_session_is_gone_is_passed_over_and_removed(
    connection: Connection, make_connection, db: psycopg.Connection, schema: str
) -> None:
    worker = make_connection(polling_interval=3600)
    got: list[object] = []
    with Consumer(worker, [Queue("q")], callbacks=[lambda body, m: (got.append(body), m.ack())]):
        with contextlib.suppress(TimeoutError):
            worker.drain_events(timeout=0.1)
        waiter = sql.Identifier(schema, "waiter")
        # consumers that died without a word: rows whose session lock nobody holds
        for ghost in ("0" * 16, "1" * 16, "2" * 16, "3" * 16):
            db.execute(sql.SQL("INSERT INTO {} VALUES ('q', %s)").format(waiter), [ghost])

        def waiters() -> int:
            row = db.execute(sql.SQL("SELECT count(*) FROM {}").format(waiter)).fetchone()
            return int(row[0]) if row else 0

        sent = 0
        while waiters() > 1 and sent < 60:  # each publish picks at random; ghosts go
            Producer(connection).publish(sent, routing_key="q")
            worker.drain_events(timeout=10)  # woken, whichever row the publish picked first
            sent += 1

        assert waiters() == 1
        assert got == list(range(sent))


def test_a_consumer_whose_window_is_full_is_not_the_one_woken(make_connection) -> None:
    """A waiter picked while it holds all it may is woken for a message it cannot take,
    while another consumer idles: a consumer with no room stops waiting."""
    busy, idle = make_connection(polling_interval=3600), make_connection(polling_interval=3600)
    held: list[object] = []
    got: list[object] = []
    with (
        Consumer(busy, [Queue("q")], callbacks=[lambda body, m: held.append(body)]) as full,
        Consumer(idle, [Queue("q")], callbacks=[lambda body, m: (got.append(body), m.ack())]),
    ):
        full.qos(prefetch_count=1)
        with contextlib.suppress(TimeoutError):
            idle.drain_events(timeout=0.1)  # has claimed once, waits
        Producer(busy).publish("kept", routing_key="q")
        busy.drain_events(timeout=10)  # whoever was woken, busy claims it (and holds it)
        got.clear()
        assert held == ["kept"]

        for i in range(6):  # each would reach the busy one half of the time
            Producer(busy).publish(i, routing_key="q")
            idle.drain_events(timeout=10)
        assert got == list(range(6)) and held == ["kept"]
