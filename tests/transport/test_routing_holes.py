"""Holes an operator found: unroutable publishes vanished without a trace, a long queue
name broke every notification, a ``%`` in the schema gave raw errors, and the
notification channel told any role the queue names."""

from __future__ import annotations

import logging
from collections.abc import Callable

import psycopg
import pytest
from kombu import Connection, Consumer, Exchange, Producer, Queue
from psycopg import sql

from kombu_pgqueue import ConfigurationError, MessageError
from kombu_pgqueue.admin import counters
from kombu_pgqueue.transport import Transport


# wakeups, not handoffs, whose payload carries the message (its properties name
# the routing key; see docs/lifecycle.md, "Wakeups")
@pytest.fixture
def transport_options(transport_options: dict[str, object]) -> dict[str, object]:
    return {**transport_options, "handoff": False}


def _notifications(conn: psycopg.Connection) -> list[str]:
    return [n.payload for n in conn.notifies(timeout=0.5, stop_after=50)]


def test_notifications_do_not_name_the_queues(connection: Connection, dsn: str) -> None:
    channel = connection.transport.options.channel
    secret = "customer-4711-invoices"
    Exchange("billing", "direct")(connection.default_channel).declare()
    Queue(secret, Exchange("billing", "direct"), routing_key="k")(
        connection.default_channel
    ).declare()
    consumed = [Queue(secret), Queue("direct")]
    with psycopg.connect(dsn, autocommit=True) as observer, Consumer(connection, consumed):
        observer.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))

        Producer(connection).publish("direct", routing_key=secret)
        Producer(connection).publish("routed", exchange="billing", routing_key="k")

        payloads = _notifications(observer)
    assert len(payloads) >= 2
    assert not any("customer" in p or "4711" in p for p in payloads), payloads


def test_fake_wakeups_are_harmless(connection: Connection, dsn: str) -> None:
    channel = connection.transport.options.channel
    got: list[str] = []
    queue = Queue("woken-for-nothing")
    with Consumer(connection, [queue], callbacks=[lambda body, m: (got.append(body), m.ack())]):
        with psycopg.connect(dsn, autocommit=True) as intruder:
            for payload in ("", "r:", "r:woken-for-nothing", "d:never", "x:y", "r:" + "0" * 16):
                intruder.execute("SELECT pg_notify(%s, %s)", [channel, payload])
        with pytest.raises(TimeoutError):
            connection.drain_events(timeout=0.5)  # woken, claims, finds nothing
        Producer(connection).publish("real", routing_key="woken-for-nothing")
        connection.drain_events(timeout=5)
    assert got == ["real"]


def test_an_over_long_queue_name_is_refused_at_declare(connection: Connection) -> None:
    with pytest.raises(ConfigurationError, match="1024 bytes"):
        Queue("q" * 1025)(connection.default_channel).declare()
    Queue("q" * 1024)(connection.default_channel).declare()


def test_a_percent_in_the_schema_option_is_refused_by_name() -> None:
    with pytest.raises(ConfigurationError, match="%"):
        _ = Connection("pgqueue://", transport_options={"schema": "per%cent"}).transport


def _unroutable(event: str = "unroutable") -> int:
    return sum(v for (name, _), v in counters().items() if name == event)


def test_an_unroutable_publish_is_logged_once_and_counted(
    connection: Connection, caplog: pytest.LogCaptureFixture
) -> None:
    Exchange("nobody-bound", "direct")(connection.default_channel).declare()
    before, transient = _unroutable(), _unroutable("unroutable_transient")

    with caplog.at_level(logging.WARNING, logger="kombu_pgqueue"):
        for _ in range(3):
            Producer(connection).publish("lost", exchange="nobody-bound", routing_key="k")
        # a transient message (Celery's events) is counted apart, not logged
        Producer(connection).publish(
            "event", exchange="nobody-bound", routing_key="e", delivery_mode=1
        )

    warned = [r for r in caplog.records if "unroutable" in r.getMessage()]
    assert len(warned) == 1
    assert "'nobody-bound'" in warned[0].getMessage() and "'k'" in warned[0].getMessage()
    # what an alert on 'unroutable' sees is what was lost, not events without a listener
    assert _unroutable() - before == 3
    assert _unroutable("unroutable_transient") - transient == 1


def test_unroutable_raise_makes_a_persistent_publish_raise(
    make_connection: Callable[..., Connection],
) -> None:
    conn = make_connection(unroutable="raise")
    Exchange("nobody-bound-2", "topic")(conn.default_channel).declare()

    with pytest.raises(MessageError, match="nobody-bound-2"):
        Producer(conn).publish("lost", exchange="nobody-bound-2", routing_key="a.b")
    Producer(conn).publish("event", exchange="nobody-bound-2", routing_key="a", delivery_mode=1)


def test_transport_declares_recoverable_connection_errors() -> None:
    """Every connection error is recoverable (Kombu reconnects and retries), and so is
    the error Kombu's own connect loop gives up with inside a publish (issue 29: a
    publish must follow its retry policy; tests/faults/test_publish_policy.py)."""
    import kombu.exceptions

    recoverable = set(Transport.recoverable_connection_errors)
    assert set(Transport.connection_errors) <= recoverable
    assert kombu.exceptions.OperationalError in recoverable
