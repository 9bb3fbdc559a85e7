"""The broker behind PgBouncer in transaction pooling mode (issue 43), a real one started
by the test (tests/pgbouncer.py): a Kombu producer and consumer and a Celery worker with
configure() work through it with nothing else changed; wakeups come from transport
option ``listen_url`` (the server itself), or, with none, by polling; a pooler that
takes LISTEN and drops what is sent to it is found at start and polled around."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from typing import Any

import pgbouncer
import pytest
from celery_workers import Worker
from fleet_app import make_app
from kombu import Connection, Consumer, Producer, Queue
from waiting import wait_for

from kombu_pgqueue import embedded


@pytest.fixture
def bouncer(dsn: str) -> Iterator[pgbouncer.PgBouncer]:
    if pgbouncer.binary() is None:
        message = "pgbouncer is not installed (apt-get install pgbouncer)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    with pgbouncer.PgBouncer.start(dsn, pool_mode="transaction", pool_size=4) as running:
        yield running


def _connection(dsn: str, schema: str, **options: Any) -> Connection:
    conn = Connection(
        embedded.broker_url(dsn),
        transport_options={"schema": schema, "batch_acks": False, **options},
    )
    conn.connect()
    return conn


def _consume_all(conn: Connection, queue: str, n: int, timeout: float = 30) -> list[Any]:
    got: list[Any] = []

    def on_message(body: Any, message: Any) -> None:
        got.append(body)
        message.ack()

    with Consumer(conn, [Queue(queue)], callbacks=[on_message], prefetch_count=10):
        wait_for(
            lambda: len(got) >= n or conn.drain_events(timeout=0.5) and False,
            timeout,
            f"{n} messages",
            ignore=(TimeoutError,),
        )
    return got


def _publish(conns: list[Connection], queue: str, n: int) -> None:
    producers = [Producer(c) for c in conns]
    for i in range(n):
        producers[i % len(producers)].publish({"i": i}, routing_key=queue, declare=[Queue(queue)])


def test_a_producer_and_a_consumer_work_through_a_transaction_pooler_and_poll(
    bouncer: pgbouncer.PgBouncer, schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="kombu_pgqueue")
    publishers = [_connection(bouncer.dsn, schema) for _ in range(3)]
    consumer = _connection(bouncer.dsn, schema, polling_interval=30)
    try:
        # more than psycopg's prepare_threshold (5) statements on each client
        _publish(publishers, "pooled", 60)
        got = _consume_all(consumer, "pooled", 60)
        assert sorted(body["i"] for body in got) == list(range(60))
        wakeups = consumer.transport.consumer.wakeups
        assert wakeups.listener is None and wakeups.poll_interval <= 1.0
        said = [
            r.getMessage() for r in caplog.records if "shares server sessions" in r.getMessage()
        ]
        assert len(said) == 1, said
        assert "listen_url" in said[0]
        # a publish to a consumer that waits: found by the next poll
        _publish(publishers, "pooled", 1)
        assert _consume_all(consumer, "pooled", 1) == [{"i": 0}]
    finally:
        for conn in [*publishers, consumer]:
            conn.release()


def test_wakeups_through_a_pooler_come_from_listen_url(
    bouncer: pgbouncer.PgBouncer, dsn: str, schema: str
) -> None:
    # a safety poll every 60 s: a delivery sooner is a NOTIFY's
    consumer = _connection(bouncer.dsn, schema, polling_interval=60, listen_url=dsn)
    publisher = _connection(bouncer.dsn, schema)
    try:
        _publish([publisher], "woken", 1)
        assert _consume_all(consumer, "woken", 1) == [{"i": 0}]
        wakeups = consumer.transport.consumer.wakeups
        assert wakeups.listener is not None and wakeups.poll_interval == 60
        _publish([publisher], "woken", 1)
        assert _consume_all(consumer, "woken", 1, timeout=20) == [{"i": 0}]
    finally:
        publisher.release()
        consumer.release()


def test_a_pooler_that_swallows_listen_is_found_at_start_and_polled_around(
    bouncer: pgbouncer.PgBouncer, schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    """listen_url pointed at the pooler by mistake: LISTEN succeeds there, and nothing
    sent to it ever arrives. The consumer says so in one line and polls."""
    caplog.set_level(logging.WARNING, logger="kombu_pgqueue")
    consumer = _connection(bouncer.dsn, schema, polling_interval=30, listen_url=bouncer.dsn)
    publisher = _connection(bouncer.dsn, schema)
    try:
        _publish([publisher], "swallowed", 3)
        got = _consume_all(consumer, "swallowed", 3)
        assert sorted(body["i"] for body in got) == [0, 1, 2]
        said = [r.getMessage() for r in caplog.records if "never came back" in r.getMessage()]
        assert len(said) == 1, said
        assert consumer.transport.consumer.wakeups.poll_interval <= 1.0
    finally:
        publisher.release()
        consumer.release()


def test_a_celery_worker_with_configure_runs_tasks_through_a_transaction_pooler(
    bouncer: pgbouncer.PgBouncer,
    fleet_worker_at: Callable[..., Worker],
    schema: str,
) -> None:
    fleet_worker_at(bouncer.dsn, pool="prefork", concurrency=2)
    app = make_app(bouncer.dsn, schema)
    try:
        results = [app.tasks["fleet.add"].delay(i, i) for i in range(30)]
        assert [r.get(timeout=60) for r in results] == [2 * i for i in range(30)]
    finally:
        app.close()


def test_a_pooler_the_check_missed_is_learned_from_the_first_refused_statement(
    bouncer: pgbouncer.PgBouncer, schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Under load another client can take the server session between the first
    connection's checks: ``pooler="none"`` stands for that here. The first statement
    refused for a prepared statement of another client's tells, once; it is sent again
    unprepared, and nothing is prepared from then on."""
    caplog.set_level(logging.WARNING, logger="kombu_pgqueue")
    publishers = [_connection(bouncer.dsn, schema, pooler="none") for _ in range(3)]
    consumer = _connection(bouncer.dsn, schema, pooler="none", polling_interval=30)
    try:
        _publish(publishers, "learned", 60)
        got = _consume_all(consumer, "learned", 60)
        assert sorted(body["i"] for body in got) == list(range(60))
        said = [r.getMessage() for r in caplog.records if "was refused" in r.getMessage()]
        assert len(said) == 1, said
    finally:
        for conn in [*publishers, consumer]:
            conn.release()
