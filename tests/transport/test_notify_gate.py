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
from datetime import datetime, timedelta, timezone

import psycopg
import pytest
from kombu import Connection, Consumer, Exchange, Producer, Queue
from psycopg import sql

from kombu_pgqueue import bulk
from kombu_pgqueue._sql import LOCKS, queries
from kombu_pgqueue.records import Outgoing
from tests.waiting import wait_for

SENTINEL = "sentinel"


# these tests are about wakeups and claims: the consumers take no handoffs
# (tests/transport/test_handoff.py)
@pytest.fixture
def transport_options(transport_options: dict[str, object]) -> dict[str, object]:
    return {**transport_options, "handoff": False}


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


def _token(observer: psycopg.Connection, connection: Connection, queue: str) -> str:
    """The wakeup of ``queue``: its random token (never its name, nor a hash of it)."""
    table = sql.Identifier(connection.transport.options.schema, "queue")
    query = sql.SQL("SELECT token FROM {} WHERE name = %s").format(table)
    row = observer.execute(query, [queue]).fetchone()
    assert row is not None, f"queue {queue!r} not declared"
    return "r:" + str(row[0])


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
        assert _sent(observer, connection) == [
            _token(observer, connection, "watched"),
            _token(observer, connection, "routed"),
        ] + [_token(observer, connection, "watched")]
    producer.publish("after the cancel", routing_key="watched")
    assert _sent(observer, connection) == []


def test_a_consumer_that_starts_while_a_publish_commits_gets_it_without_polling(
    make_connection, dsn: str, schema: str
) -> None:
    """The publish looked for a waiting consumer before the consumer started waiting,
    and commits after it: the consumer's first claim must wait for that commit."""
    worker = make_connection(polling_interval=3600)
    publish = queries(schema)["publish"]
    got: list[object] = []
    with psycopg.connect(dsn) as publisher:  # a transaction, open until commit()
        message = Outgoing(
            queue="late",
            body=b'"in flight"',
            headers="{}",
            properties="{}",
            content_type="application/json",
            content_encoding="utf-8",
        )
        params = worker.default_channel.store.publish_params(message)
        publisher.execute(publish, {**params, "gate": True})
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
                    " AND classid = %s AND NOT granted",
                    [LOCKS["lock_publishing"]],
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
        assert _sent(observer, connection) == [_token(observer, connection, "busy")]
        worker.drain_events(timeout=5)
    assert got == [*range(10), "while busy", "once drained"]


def test_a_delayed_message_always_tells_its_due_time(
    connection: Connection, observer: psycopg.Connection
) -> None:
    """Consumers that are busy with a backlog (not waiting) promote due messages when told
    the due time; without it, a countdown task would fire up to a safety poll late."""
    eta = (datetime.now(timezone.utc) + timedelta(minutes=1)).isoformat()
    Producer(connection).publish("later", routing_key="nobody waits", headers={"eta": eta})
    (payload,) = _sent(observer, connection)
    assert payload.startswith("d:")


def test_a_callback_that_raises_leaves_the_queue_to_be_claimed_again(
    make_connection,
) -> None:
    """With callback_errors="raise", a batch cut short by a raising callback must leave its
    queue pending: the rest of the queue, and what comes next, are claimed without a poll."""
    worker = make_connection(polling_interval=3600, callback_errors="raise")
    got: list[object] = []
    raised: list[object] = []

    def on_message(body: object, message: object) -> None:
        if body == 100 and not raised:
            raised.append(body)
            raise ValueError("the consumer's callback failed")
        got.append(body)
        message.ack()  # type: ignore[attr-defined]

    with Consumer(worker, [Queue("q")], callbacks=[on_message]):
        with contextlib.suppress(TimeoutError):
            worker.drain_events(timeout=0.1)
        producer = Producer(worker)
        for i in range(150):
            producer.publish(i, routing_key="q")
        worker.drain_events(timeout=10)  # a full batch: more is waiting
        with pytest.raises(ValueError):
            worker.drain_events(timeout=10)  # the next batch, whose first raises
        producer.publish("after", routing_key="q")
        while len(got) < 150:
            worker.drain_events(timeout=10)
    assert got[-1] == "after" and len(set(got)) == 150
