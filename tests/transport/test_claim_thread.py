"""Claims on the claim thread (Transport._claimer) for consumers in an event loop.

The thread only claims; the event loop's thread delivers. These tests drive a real
Hub and a real database, and step in between "the claim came back" and "the loop
delivered it" to check what happens to messages claimed for a consumer that went away
meanwhile, to wakeups that arrive while a claim is in flight, and to the prefetch
window.
"""

from __future__ import annotations

import select
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from kombu import Connection, Consumer, Producer, Queue
from kombu.asynchronous import Hub

from kombu_pgqueue._listener import Wakeups
from kombu_pgqueue._store import Store

QUIET = {"polling_interval": 30}


@pytest.fixture
def hub() -> Iterator[Hub]:
    loop = Hub()
    yield loop
    loop.close()


def _fill(conn: Connection, queue: str, n: int) -> None:
    producer = Producer(conn)
    for i in range(n):
        producer.publish(i, routing_key=queue, declare=[Queue(queue)])


def _claim_returned(conn: Connection, timeout: float = 10) -> None:
    """Wait until the claim thread has a result (without letting the loop take it)."""
    claimer = conn.transport._claimer
    assert claimer is not None
    ready, _, _ = select.select([claimer.fileno()], [], [], timeout)
    assert ready, "the claim thread brought nothing back"


def _busy(conn: Connection) -> None:
    """Make the transport count as delivering all along, so no claim goes inline.

    An idle consumer (nothing delivered for IDLE_INLINE_SECONDS) claims in the loop's
    own thread; these tests are about the claim thread.
    """
    conn.transport._last_delivery = time.monotonic() + 3600


def _registered(
    make_connection: Callable[..., Connection], hub: Hub, queue: str, n: int, busy: bool = True
) -> Connection:
    """A connection in ``hub``'s loop, with ``n`` messages waiting in ``queue``."""
    conn = make_connection(**QUIET)
    _fill(conn, queue, n)
    conn.transport.register_with_event_loop(conn.connection, hub)
    if busy:
        _busy(conn)
    return conn


def _failing_on_second(
    make_connection: Callable[..., Connection], hub: Hub, queue: str, prefetch: int
) -> tuple[Connection, list[int]]:
    """A consumer of five messages in ``queue`` whose callback raises on the second."""
    conn = _registered(make_connection, hub, queue, 5, busy=False)
    got: list[int] = []

    def on_message(body: int, message: Any) -> None:
        got.append(body)
        if body == 1:
            raise RuntimeError("the consumer's callback failed")

    Consumer(conn, [Queue(queue)], callbacks=[on_message], prefetch_count=prefetch).consume()
    conn.transport._pending.add(queue)
    return conn, got


def _spy_fetch_threads(conn: Connection) -> list[str]:
    """The name of the thread of every claim on ``conn``'s default channel, in order."""
    threads: list[str] = []
    channel = conn.default_channel
    fetch = channel.fetch

    def spy(queue: str, limit: int) -> list[Any]:
        threads.append(threading.current_thread().name)
        return fetch(queue, limit)

    channel.fetch = spy
    return threads


def _run_until(hub: Hub, done: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not done() and time.monotonic() < deadline:
        hub.run_once()


def test_claims_run_on_their_own_thread_and_deliver_in_the_loop_thread(
    make_connection: Callable[..., Connection], hub: Hub
) -> None:
    conn = _registered(make_connection, hub, "ct", 30)
    fetch_threads = _spy_fetch_threads(conn)
    got: list[tuple[int, str]] = []
    Consumer(
        conn,
        [Queue("ct")],
        callbacks=[lambda body, m: (got.append((body, threading.current_thread().name)), m.ack())],
        prefetch_count=4,
    ).consume()

    _run_until(hub, lambda: len(got) == 30, 20)

    assert [body for body, _ in got] == list(range(30))
    assert {name for _, name in got} == {threading.current_thread().name}
    assert set(fetch_threads) == {"pgqueue-claimer"}


def test_a_claim_never_brings_more_than_the_prefetch_window(
    make_connection: Callable[..., Connection], hub: Hub
) -> None:
    conn = _registered(make_connection, hub, "ctw", 20)
    held: list[Any] = []
    Consumer(
        conn, [Queue("ctw")], callbacks=[lambda b, m: held.append(m)], prefetch_count=3
    ).consume()

    _run_until(hub, lambda: len(held) >= 3, 10)
    for _ in range(20):  # more ticks: nothing else may come while three are unacked
        hub.run_once()

    assert len(held) == 3
    assert conn.default_channel._claiming == 0


def test_messages_claimed_for_a_consumer_cancelled_meanwhile_come_back_at_once(
    make_connection: Callable[..., Connection], hub: Hub, store: Store
) -> None:
    conn = _registered(make_connection, hub, "ctc", 5)
    transport = conn.transport
    got: list[int] = []
    consumer = Consumer(
        conn, [Queue("ctc")], callbacks=[lambda b, m: got.append(b)], prefetch_count=10
    )
    consumer.consume()

    transport._deliver_pending()  # starts the claim on the claim thread
    _claim_returned(conn)
    consumer.cancel()
    transport._on_claimed()

    assert got == []
    # released, not left leased until the lease ends: claimable right away
    assert len(store.claim("ctc", 10, 1)) == 5


def test_a_wakeup_during_a_short_claim_keeps_the_queue_pending(
    make_connection: Callable[..., Connection], hub: Hub
) -> None:
    conn = _registered(make_connection, hub, "ctn", 1)
    transport = conn.transport
    got: list[int] = []
    Consumer(
        conn, [Queue("ctn")], callbacks=[lambda b, m: (got.append(b), m.ack())], prefetch_count=10
    ).consume()

    transport._pending.add("ctn")
    transport._deliver_pending()
    _claim_returned(conn)
    # a NOTIFY for a message committed after the claim's snapshot arrives meanwhile
    transport._wake(Wakeups(queues={"ctn"}, due=None))
    transport._on_claimed()

    assert got == [0]
    assert "ctn" in transport._pending  # claimed again, not left for the safety poll


def test_a_database_error_on_the_claim_thread_reaches_the_event_loop(
    make_connection: Callable[..., Connection], hub: Hub
) -> None:
    conn = _registered(make_connection, hub, "cte", 1)
    transport = conn.transport
    Consumer(conn, [Queue("cte")], callbacks=[lambda b, m: m.ack()]).consume()

    def broken(queue: str, limit: int) -> list[Any]:
        raise psycopg.OperationalError("the server closed the connection")

    conn.default_channel.fetch = broken
    transport._pending.add("cte")
    transport._deliver_pending()
    _claim_returned(conn)

    with pytest.raises(psycopg.OperationalError):
        transport._on_claimed()
    assert "cte" in transport._pending
    assert conn.default_channel._claiming == 0


def test_a_callback_error_mid_batch_releases_the_rest_of_the_batch(
    make_connection: Callable[..., Connection], hub: Hub, store: Store
) -> None:
    conn, got = _failing_on_second(make_connection, hub, "ctx", 10)
    transport = conn.transport
    _busy(conn)
    transport._claimer.submit(conn.default_channel, "ctx", 5)  # one batch of 5
    transport._inflight.add("ctx")
    _claim_returned(conn)

    with pytest.raises(RuntimeError):
        transport._on_claimed()

    assert got == [0, 1]
    # 2, 3 and 4 were claimed but never handed out: released, claimable at once
    assert sorted(bytes(row.body) for row in store.claim("ctx", 10, 1)) == [b"2", b"3", b"4"]
    assert "ctx" not in transport._inflight


def test_a_callback_error_in_an_idle_consumers_inline_claim_releases_the_rest(
    make_connection: Callable[..., Connection], hub: Hub, store: Store
) -> None:
    conn, got = _failing_on_second(make_connection, hub, "ctxi", 5)
    transport = conn.transport

    with pytest.raises(RuntimeError):
        transport._deliver_pending()  # idle: claims all 5 in this thread

    assert got == [0, 1]
    assert transport._inflight == set()
    assert sorted(bytes(row.body) for row in store.claim("ctxi", 10, 1)) == [b"2", b"3", b"4"]


def test_drain_events_still_delivers_while_registered_with_a_loop(
    make_connection: Callable[..., Connection], hub: Hub
) -> None:
    conn = _registered(make_connection, hub, "ctd", 3)
    got: list[int] = []
    Consumer(conn, [Queue("ctd")], callbacks=[lambda b, m: (got.append(b), m.ack())]).consume()

    deadline = time.monotonic() + 10
    while len(got) < 3 and time.monotonic() < deadline:
        conn.drain_events(timeout=1)

    assert got == [0, 1, 2]


def test_an_idle_consumer_claims_in_the_loop_thread_then_hands_claims_to_the_thread(
    make_connection: Callable[..., Connection], hub: Hub
) -> None:
    conn = _registered(make_connection, hub, "cti", 0, busy=False)
    fetch_threads = _spy_fetch_threads(conn)
    got: list[int] = []
    Consumer(
        conn,
        [Queue("cti")],
        callbacks=[lambda body, m: (got.append(body), m.ack())],
        prefetch_count=4,
    ).consume()
    # the first tick claims (on the claim thread) and finds nothing
    _run_until(hub, lambda: bool(fetch_threads) and not conn.transport._inflight, 10)
    del fetch_threads[:]
    _fill(conn, "cti", 30)  # the NOTIFY wakes the idle consumer through its LISTEN socket

    _run_until(hub, lambda: len(got) == 30, 20)

    assert got == list(range(30))
    # the first claim found the consumer idle; later ones came while it held messages
    assert fetch_threads[0] == threading.current_thread().name
    assert "pgqueue-claimer" in fetch_threads[1:]


def test_a_tick_callback_never_claims_inline_even_for_an_idle_consumer(
    make_connection: Callable[..., Connection], hub: Hub
) -> None:
    # Celery's prefork pool schedules the writes of the tasks handed to it in a tick
    # callback of its own; a task handed over from a tick callback that runs after it
    # waited for the next tick, seconds away (chaos listenkill, 2026-11-24)
    conn = _registered(make_connection, hub, "ctt", 1, busy=False)
    fetch_threads = _spy_fetch_threads(conn)
    got: list[int] = []
    Consumer(
        conn, [Queue("ctt")], callbacks=[lambda b, m: (got.append(b), m.ack())], prefetch_count=4
    ).consume()

    conn.transport._on_tick()  # the first tick: its safety poll finds the message

    assert got == []  # nothing was handed out from within the tick
    _run_until(hub, lambda: got == [0], 10)
    assert got == [0]
    assert fetch_threads == ["pgqueue-claimer"]
