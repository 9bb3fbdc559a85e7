"""Asynchronous claims (Transport._claimer) for consumers in an event loop.

The loop sends a claim on the claimer's own connection and goes on; when the answer
is in (the socket is a reader of the loop) it delivers. These tests drive a real Hub
and a real database, and step in between "the claim came back" and "the loop
delivered it" to check what happens to messages claimed for a consumer that went away
meanwhile, to wakeups that arrive while a claim is in flight, to the prefetch window,
and to a claim that fails in the database or is in flight when the claimer closes.
"""

from __future__ import annotations

import select
import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from kombu import Connection, Consumer, Producer, Queue
from kombu.asynchronous import Hub

from kombu_pgqueue._listener import Wakeups
from kombu_pgqueue._store import Store

QUIET = {"polling_interval": 30}


def _fill(conn: Connection, queue: str, n: int) -> None:
    producer = Producer(conn)
    for i in range(n):
        producer.publish(i, routing_key=queue, declare=[Queue(queue)])


def _claim_returned(conn: Connection, timeout: float = 10) -> None:
    """Wait until the claim's answer is readable (without letting the loop take it)."""
    claimer = conn.transport._claimer
    assert claimer is not None
    ready, _, _ = select.select([claimer.fileno()], [], [], timeout)
    assert ready, "the claim brought nothing back"


def _busy(conn: Connection) -> None:
    """Make the transport count as delivering all along, so no claim goes inline.

    An idle consumer (nothing delivered for IDLE_INLINE_SECONDS) claims in the loop's
    own thread, waiting; these tests are about claims that do not wait.
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


def _consume(
    conn: Connection, queue: str, prefetch: int | None = None, ack: bool = True
) -> list[Any]:
    """Consume ``queue`` on ``conn``; return the list the bodies are appended to."""
    got: list[Any] = []

    def on_message(body: Any, message: Any) -> None:
        got.append(body)
        if ack:
            message.ack()

    Consumer(conn, [Queue(queue)], callbacks=[on_message], prefetch_count=prefetch).consume()
    return got


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


def _spy_claims(conn: Connection) -> list[str]:
    """How each claim on ``conn`` went, in order: "waited" (the loop's thread waited for
    the answer) or "sent" (sent without waiting, the answer read when it came)."""
    how: list[str] = []
    channel = conn.default_channel
    fetch = channel.fetch
    claimer = conn.transport._claimer
    assert claimer is not None
    submit = claimer.submit

    def spy_fetch(queue: str, limit: int) -> list[Any]:
        how.append("waited")
        return fetch(queue, limit)

    def spy_submit(channel: Any, queue: str, limit: int) -> None:
        how.append("sent")
        submit(channel, queue, limit)

    channel.fetch = spy_fetch
    claimer.submit = spy_submit  # type: ignore[method-assign]
    return how


def test_claims_are_sent_without_waiting_and_delivered_in_the_loop_thread(
    make_connection: Callable[..., Connection], hub: Hub
) -> None:
    conn = _registered(make_connection, hub, "ct", 30)
    transport = conn.transport
    how = _spy_claims(conn)
    got: list[tuple[int, str]] = []
    Consumer(
        conn,
        [Queue("ct")],
        callbacks=[lambda body, m: (got.append((body, threading.current_thread().name)), m.ack())],
        prefetch_count=4,
    ).consume()

    transport._pending.add("ct")
    transport._deliver_pending()
    assert got == [] and "ct" in transport._inflight  # sent; the loop did not wait
    hub.run_until(lambda: len(got) == 30, 20)

    assert [body for body, _ in got] == list(range(30))
    assert {name for _, name in got} == {threading.current_thread().name}
    assert set(how) == {"sent"} and len(how) >= 8  # batches of at most 4
    assert transport._inflight == set()


def test_a_claim_never_brings_more_than_the_prefetch_window(
    make_connection: Callable[..., Connection], hub: Hub
) -> None:
    conn = _registered(make_connection, hub, "ctw", 20)
    held: list[Any] = []
    Consumer(
        conn, [Queue("ctw")], callbacks=[lambda b, m: held.append(m)], prefetch_count=3
    ).consume()

    hub.run_until(lambda: len(held) >= 3, 10)
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
    got = _consume(conn, "ctn", 10)

    transport._pending.add("ctn")
    transport._deliver_pending()
    _claim_returned(conn)
    # a NOTIFY for a message committed after the claim's snapshot arrives meanwhile
    transport._wake(Wakeups(queues={"ctn"}, due=None))
    transport._on_claimed()

    assert got == [0]
    assert "ctn" in transport._pending  # claimed again, not left for the safety poll


def _locked(dsn: str, schema: str) -> psycopg.Connection:
    """A session holding the message table's strongest lock: claims wait behind it."""
    holder = psycopg.connect(dsn)
    holder.execute(f'LOCK TABLE "{schema}".message IN ACCESS EXCLUSIVE MODE')
    return holder


def test_a_claim_whose_connection_dies_raises_in_the_loop_and_keeps_the_queue_pending(
    make_connection: Callable[..., Connection], hub: Hub, dsn: str, schema: str, db: Any
) -> None:
    conn = _registered(make_connection, hub, "cte", 1)
    transport = conn.transport
    Consumer(conn, [Queue("cte")], callbacks=[lambda b, m: m.ack()]).consume()
    claimer = transport._claimer
    holder = _locked(dsn, schema)
    try:
        transport._pending.add("cte")
        transport._deliver_pending()  # the claim waits for the lock, in the database
        assert "cte" in transport._inflight
        db.execute("SELECT pg_terminate_backend(%s)", (claimer._pgconn.backend_pid,))
        _claim_returned(conn)
    finally:
        holder.close()

    with pytest.raises(psycopg.OperationalError, match="administrator command"):
        hub.run_until(lambda: False, 5)  # the loop reads the error, then the closed socket
    assert "cte" in transport._pending  # claimed again after the reconnect
    assert "cte" not in transport._inflight
    assert conn.default_channel._claiming == 0


def test_a_claim_that_fails_in_the_database_raises_in_the_loop_and_the_next_one_works(
    make_connection: Callable[..., Connection], hub: Hub, dsn: str, schema: str
) -> None:
    conn = _registered(make_connection, hub, "ctq", 2)
    transport = conn.transport
    got = _consume(conn, "ctq", 1)
    claimer = transport._claimer
    claimer._pgconn.exec_(b"SET statement_timeout = 100")
    holder = _locked(dsn, schema)
    try:
        transport._pending.add("ctq")
        transport._deliver_pending()
        _claim_returned(conn)  # the statement timeout's error
        with pytest.raises(psycopg.errors.QueryCanceled):
            transport._on_claimed()
    finally:
        holder.close()
    assert got == [] and transport._inflight == set()
    assert "ctq" in transport._pending

    hub.run_until(lambda: got == [0, 1], 10)  # the same connection claims again
    assert got == [0, 1]


def test_a_claim_in_flight_when_the_claimer_closes_is_released_at_once(
    make_connection: Callable[..., Connection], hub: Hub, store: Store
) -> None:
    conn = _registered(make_connection, hub, "ctz", 5)
    transport = conn.transport
    got = _consume(conn, "ctz", 10, ack=False)

    transport._pending.add("ctz")
    transport._deliver_pending()
    assert "ctz" in transport._inflight
    transport._stop_claimer()  # as when the worker stops or reconnects

    assert got == []
    # the claim was awaited and what it leased released: claimable right away
    assert len(store.claim("ctz", 10, 1)) == 5


def test_claims_without_prepared_statements_deliver_too(
    make_connection: Callable[..., Connection], hub: Hub
) -> None:
    # prepare_threshold None is the setting behind PgBouncer in transaction mode
    conn = make_connection(prepare_threshold=None, **QUIET)
    _fill(conn, "ctu", 10)
    conn.transport.register_with_event_loop(conn.connection, hub)
    _busy(conn)
    how = _spy_claims(conn)
    got = _consume(conn, "ctu", 4)

    hub.run_until(lambda: len(got) == 10, 10)

    assert got == list(range(10))
    assert set(how) == {"sent"}
    with psycopg.connect(conn.transport.store.conninfo) as check:
        # nothing was prepared in the claimer's session
        pid = conn.transport._claimer._pgconn.backend_pid
        assert check.execute("SELECT pid FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone()
    assert conn.transport._claimer._prepared == {}


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
    got = _consume(conn, "ctd")

    deadline = time.monotonic() + 10
    while len(got) < 3 and time.monotonic() < deadline:
        conn.drain_events(timeout=1)

    assert got == [0, 1, 2]


def test_an_idle_consumer_waits_for_its_claim_then_sends_claims_without_waiting(
    make_connection: Callable[..., Connection], hub: Hub
) -> None:
    conn = _registered(make_connection, hub, "cti", 0, busy=False)
    how = _spy_claims(conn)
    got: list[int] = []
    Consumer(
        conn,
        [Queue("cti")],
        callbacks=[lambda body, m: (got.append(body), m.ack())],
        prefetch_count=4,
    ).consume()
    # the first tick claims (sent, see below) and finds nothing
    hub.run_until(lambda: bool(how) and not conn.transport._inflight, 10)
    del how[:]
    _fill(conn, "cti", 30)  # the NOTIFY wakes the idle consumer through its LISTEN socket

    hub.run_until(lambda: len(got) == 30, 20)

    assert got == list(range(30))
    # the first claim found the consumer idle; later ones came while it held messages
    assert how[0] == "waited"
    assert "sent" in how[1:]


def test_a_tick_callback_never_claims_inline_even_for_an_idle_consumer(
    make_connection: Callable[..., Connection], hub: Hub
) -> None:
    # Celery's prefork pool schedules the writes of the tasks handed to it in a tick
    # callback of its own; a task handed over from a tick callback that runs after it
    # waited for the next tick, seconds away (chaos listenkill, 2026-11-24)
    conn = _registered(make_connection, hub, "ctt", 1, busy=False)
    how = _spy_claims(conn)
    got = _consume(conn, "ctt", 4)

    conn.transport._on_tick()  # the first tick: its safety poll finds the message

    assert got == []  # nothing was handed out from within the tick
    hub.run_until(lambda: got == [0], 10)
    assert got == [0]
    assert how == ["sent"]


def test_a_claim_session_ended_while_idle_raises_in_the_loop_instead_of_spinning(
    make_connection: Callable[..., Connection], hub: Hub, db: Any
) -> None:
    conn = _registered(make_connection, hub, "cts", 0)
    transport = conn.transport
    Consumer(conn, [Queue("cts")], callbacks=[lambda b, m: m.ack()]).consume()
    hub.run_until(lambda: not transport._inflight and "cts" not in transport._pending, 5)
    claimer = transport._claimer
    calls = []
    on_claimed = transport._on_claimed

    def counting(fileno: int | None = None) -> None:
        calls.append(fileno)
        on_claimed(fileno)

    hub.remove_reader(claimer.fileno())
    hub.add_reader(claimer.fileno(), counting, claimer.fileno())
    db.execute("SELECT pg_terminate_backend(%s)", (claimer._pgconn.backend_pid,))
    _claim_returned(conn)  # readable: the server's goodbye

    with pytest.raises(psycopg.OperationalError):
        hub.run_until(lambda: False, 5)
    assert len(calls) <= 2  # the first read raised (or the second, after the error message)


def test_only_time_in_the_server_counts_a_claim_as_slow_not_a_busy_loop(
    make_connection: Callable[..., Connection], hub: Hub, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a slow claim (a long walk over acked rows at the head) makes the consumer resume
    # after its last message for a while; a loop that was busy when the answer came
    # must not, or priorities and requeues would wait for nothing
    from kombu_pgqueue import transport as pgq

    monkeypatch.setattr(pgq, "SLOW_CLAIM_SECONDS", 0.1)
    conn = _registered(make_connection, hub, "ctslow", 4)
    transport = conn.transport
    channel = conn.default_channel
    got = _consume(conn, "ctslow", 1, ack=False)

    transport._pending.add("ctslow")
    transport._deliver_pending()
    _claim_returned(conn)  # the answer waits in the socket...
    clock = time.perf_counter
    # ...while the loop is busy elsewhere for 0.3 s by the client's clock
    monkeypatch.setattr(time, "perf_counter", lambda: clock() + 0.3)
    transport._on_claimed()
    monkeypatch.setattr(time, "perf_counter", clock)
    assert got == [0]
    assert "ctslow" not in channel._resume

    # the same claim with any time in the server counting as slow: it resumes
    monkeypatch.setattr(pgq, "SLOW_CLAIM_SECONDS", 0.0)
    got.clear()
    channel.qos._delivered.clear()  # the window opens again without an ack
    channel.qos._dirty.clear()
    transport._pending.add("ctslow")
    transport._deliver_pending()
    _claim_returned(conn)
    transport._on_claimed()
    assert got == [1]
    assert channel._resume["ctslow"][:2] == (0, channel._resume["ctslow"][1])
    assert channel._resume["ctslow"][2] > time.monotonic()
