"""LISTEN/NOTIFY wake-ups and Kombu's event loop (the Hub Celery's worker runs).

``polling_interval=30`` in these tests: nothing but a notification can wake the
consumer within their time bounds. The bounds are generous on purpose; they tell
"woken by NOTIFY" from "woken by the next poll", they are not latency targets.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from kombu import Connection, Consumer, Producer, Queue
from kombu.asynchronous import Hub

from kombu_pgqueue._store import new_lease

QUIET = {"polling_interval": 30}


def _publish_later(
    conn: Connection, queue: str, body: Any, delay: float, **kwargs: Any
) -> tuple[threading.Thread, list[float]]:
    """Publish from another thread after ``delay`` seconds; return (thread, [publish time])."""
    published: list[float] = []

    def run() -> None:
        threading.Event().wait(delay)
        Producer(conn).publish(body, routing_key=queue, declare=[Queue(queue)], **kwargs)
        published.append(time.monotonic())

    thread = threading.Thread(target=run)
    thread.start()
    return thread, published


def test_notify_wakes_a_consumer_blocked_in_drain_events(
    make_connection: Callable[..., Connection],
) -> None:
    consumer_conn = make_connection(**QUIET)
    publisher = make_connection()
    got: list[tuple[Any, float]] = []
    Consumer(
        consumer_conn,
        [Queue("woken")],
        callbacks=[lambda body, m: (got.append((body, time.monotonic())), m.ack())],
    ).consume()

    started = time.monotonic()
    thread, published = _publish_later(publisher, "woken", "ping", 0.5)
    consumer_conn.drain_events(timeout=10)
    thread.join(timeout=10)

    [(body, delivered_at)] = got
    assert body == "ping"
    assert delivered_at >= published[0] - 0.05  # it was waiting when the message came
    assert delivered_at - started < 5


def test_without_notify_a_blocked_consumer_waits_for_the_poll(
    make_connection: Callable[..., Connection],
) -> None:
    # the control for the test above: the same setup, LISTEN off, is not woken
    consumer_conn = make_connection(listen=False, **QUIET)
    publisher = make_connection()
    got: list[Any] = []
    Consumer(
        consumer_conn, [Queue("not-woken")], callbacks=[lambda body, m: got.append(m)]
    ).consume()

    thread, _ = _publish_later(publisher, "not-woken", "ping", 0.2)
    with pytest.raises(socket.timeout):
        consumer_conn.drain_events(timeout=1.0)
    thread.join(timeout=10)

    assert got == []


def test_drain_events_delivers_a_delayed_message_when_it_falls_due(
    make_connection: Callable[..., Connection],
) -> None:
    consumer_conn = make_connection(**QUIET)
    publisher = make_connection()
    got: list[tuple[Any, float]] = []
    Consumer(
        consumer_conn,
        [Queue("delayed")],
        callbacks=[lambda body, m: (got.append((body, time.time())), m.ack())],
    ).consume()
    eta = datetime.now(timezone.utc) + timedelta(seconds=1)

    thread, _ = _publish_later(publisher, "delayed", "later", 0.0, headers={"eta": eta.isoformat()})
    consumer_conn.drain_events(timeout=10)
    thread.join(timeout=10)

    [(body, delivered_at)] = got
    assert body == "later"
    assert eta.timestamp() - 0.05 <= delivered_at < eta.timestamp() + 4


def test_hub_delivers_on_notify(make_connection: Callable[..., Connection], hub: Hub) -> None:
    consumer_conn = make_connection(**QUIET)
    publisher = make_connection()
    consumer_conn.transport.register_with_event_loop(consumer_conn.connection, hub)
    got: list[tuple[Any, float]] = []
    Consumer(
        consumer_conn,
        [Queue("hub-woken")],
        callbacks=[lambda body, m: (got.append((body, time.monotonic())), m.ack())],
    ).consume()

    started = time.monotonic()
    thread, published = _publish_later(publisher, "hub-woken", "ping", 0.3)
    hub.run_until(lambda: bool(got), 10)
    thread.join(timeout=10)

    [(body, delivered_at)] = got
    assert body == "ping"
    assert delivered_at >= published[0] - 0.05
    assert delivered_at - started < 5


def test_hub_delivers_a_delayed_message_when_it_falls_due(
    make_connection: Callable[..., Connection], hub: Hub
) -> None:
    consumer_conn = make_connection(**QUIET)
    publisher = make_connection()
    consumer_conn.transport.register_with_event_loop(consumer_conn.connection, hub)
    got: list[tuple[Any, float]] = []
    Consumer(
        consumer_conn,
        [Queue("hub-delayed")],
        callbacks=[lambda body, m: (got.append((body, time.time())), m.ack())],
    ).consume()
    eta = datetime.now(timezone.utc) + timedelta(seconds=1)

    thread, _ = _publish_later(
        publisher, "hub-delayed", "later", 0.0, headers={"eta": eta.isoformat()}
    )
    hub.run_until(lambda: bool(got), 10)
    thread.join(timeout=10)

    [(body, delivered_at)] = got
    assert body == "later"
    assert eta.timestamp() - 0.05 <= delivered_at < eta.timestamp() + 4


def test_ack_from_another_thread_while_the_hub_runs(
    make_connection: Callable[..., Connection], hub: Hub, later: Callable[[float], datetime]
) -> None:
    # Celery's thread pool acks from worker threads while the consuming thread
    # sits in the event loop; with prefetch 1 each ack must open the window again
    # (at the loop's next tick: a short polling_interval keeps the ticks coming)
    connection = make_connection(polling_interval=0.1)
    connection.transport.register_with_event_loop(connection.connection, hub)
    queue = Queue("hub-ack")
    producer = Producer(connection)
    for n in range(3):
        producer.publish(n, routing_key="hub-ack", declare=[queue])
    events: list[tuple[str, int]] = []
    errors: list[BaseException] = []
    ackers: list[threading.Thread] = []
    lock = threading.Lock()
    main_thread = threading.get_ident()

    def ack_in_thread(body: int, message: Any) -> None:
        try:
            assert threading.get_ident() != main_thread
            message.ack()
            with lock:
                events.append(("ack", body))
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    def on_message(body: int, message: Any) -> None:
        with lock:
            events.append(("deliver", body))
        acker = threading.Thread(target=ack_in_thread, args=(body, message))
        ackers.append(acker)
        acker.start()

    consumer = Consumer(connection, [queue], callbacks=[on_message], prefetch_count=1)
    consumer.consume()
    hub.run_until(lambda: sum(kind == "ack" for kind, _ in events) == 3, 15)
    for acker in ackers:
        acker.join(timeout=10)

    assert errors == []
    assert [body for kind, body in events if kind == "deliver"] == [0, 1, 2]
    for n in (1, 2):  # prefetch 1: the next came only after the previous ack
        assert events.index(("ack", n - 1)) < events.index(("deliver", n))
    store = connection.default_channel.store
    assert store.size("hub-ack", now=later(3600)) == 0
    assert store.claim("hub-ack", 10, new_lease(), now=later(3600)) == []
    consumer.cancel()
