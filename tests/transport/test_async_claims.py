"""Asynchronous claims (the consumer's claimer) for consumers in an event loop.

The loop sends a claim on the claimer's own connection and goes on; when the answer
is in (the socket is a reader of the loop) it delivers. These tests drive a real Hub
and a real database, and step in between "the claim came back" and "the loop
delivered it" (the consumer's deliver_pending and on_claimed, which the loop calls)
to check what happens to messages claimed for a consumer that went away
meanwhile, to wakeups that arrive while a claim is in flight, to the prefetch window,
and to a claim that fails in the database or is in flight when the claimer closes.
"""

from __future__ import annotations

import logging
import select
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest
from helpers import ALWAYS_RESUMED, fill
from kombu import Connection, Consumer, Producer, Queue
from kombu.asynchronous import Hub
from wire_faults import AnswerSplitter

from kombu_pgqueue import _pacing
from kombu_pgqueue._store import Store

QUIET = {"polling_interval": 30}


def _claim_returned(conn: Connection, timeout: float = 10) -> None:
    """Wait until the claim's answer is readable (without letting the loop take it)."""
    claimer = conn.transport.consumer.claimer
    assert claimer is not None
    ready, _, _ = select.select([claimer.fileno()], [], [], timeout)
    assert ready, "the claim brought nothing back"


def _take_answer(conn: Connection, queue: str) -> None:
    """Let the consumer read the claim's answer, as the loop does when its socket is
    readable (or in its tick, for an answer already read): once readable, the answer
    may still be on its way in parts."""
    consumer = conn.transport.consumer
    while queue in consumer.in_flight:
        claimer = consumer.claimer
        # the answer was read already when a statement of the listener's, which
        # shares the session, waited for it (the loop's next tick takes it)
        if claimer is None or not claimer.answered:
            _claim_returned(conn)
        consumer.on_claimed()


@pytest.fixture
def busy(transport_options: dict[str, object]) -> None:
    """Make consumers count as delivering all along, so no claim goes inline.

    An idle consumer (nothing delivered for ``idle_inline_seconds``) claims in the
    loop's own thread, waiting; tests that use this are about claims that do not wait.
    """
    transport_options["idle_inline_seconds"] = float("inf")


def _registered(
    make_connection: Callable[..., Connection], hub: Hub, queue: str, n: int, **options: Any
) -> Connection:
    """A connection in ``hub``'s loop, with ``n`` messages waiting in ``queue``."""
    conn = make_connection(**QUIET, **options)
    fill(conn, queue, range(n))
    conn.transport.register_with_event_loop(conn.connection, hub)
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


def _holding(conn: Connection, queue: str, prefetch: int) -> list[Any]:
    """Consume ``queue`` on ``conn`` within a window of ``prefetch``; return the list the
    messages are appended to, unacked (the test acks them)."""
    held: list[Any] = []
    Consumer(
        conn, [Queue(queue)], callbacks=[lambda b, m: held.append(m)], prefetch_count=prefetch
    ).consume()
    return held


def _failing_on_second(
    make_connection: Callable[..., Connection],
    hub: Hub,
    queue: str,
    prefetch: int,
    callback_errors: str = "raise",
) -> tuple[Connection, list[int]]:
    """A consumer of five messages in ``queue`` whose callback raises on the second."""
    conn = _registered(make_connection, hub, queue, 5, callback_errors=callback_errors)
    got: list[int] = []

    def on_message(body: int, message: Any) -> None:
        got.append(body)
        if body == 1:
            raise RuntimeError("the consumer's callback failed")

    Consumer(conn, [Queue(queue)], callbacks=[on_message], prefetch_count=prefetch).consume()
    conn.transport.consumer.notice(queue)
    return conn, got


def _spy_claims(conn: Connection, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """How each claim on ``conn`` went, in order: "waited" (the loop's thread waited for
    the answer) or "sent" (sent without waiting, the answer read when it came)."""
    how: list[str] = []
    consumer = conn.transport.consumer
    claimer = consumer.claimer
    assert claimer is not None
    run_claim, submit = consumer.store.run_claim, claimer.submit

    def spy_run_claim(*args: Any) -> Any:
        how.append("waited")
        return run_claim(*args)

    def spy_submit(request: Any) -> None:
        how.append("sent")
        submit(request)

    monkeypatch.setattr(consumer.store, "run_claim", spy_run_claim)
    monkeypatch.setattr(claimer, "submit", spy_submit)
    return how


@pytest.mark.usefixtures("busy")
def test_claims_are_sent_without_waiting_and_delivered_in_the_loop_thread(
    make_connection: Callable[..., Connection], hub: Hub, monkeypatch: pytest.MonkeyPatch
) -> None:
    conn = _registered(make_connection, hub, "ct", 30)
    consumer = conn.transport.consumer
    how = _spy_claims(conn, monkeypatch)
    got: list[tuple[int, str]] = []
    Consumer(
        conn,
        [Queue("ct")],
        callbacks=[lambda body, m: (got.append((body, threading.current_thread().name)), m.ack())],
        prefetch_count=4,
    ).consume()

    consumer.notice("ct")
    consumer.deliver_pending()
    assert got == [] and "ct" in consumer.in_flight  # sent; the loop did not wait
    # drained, it watches the queue again and claims once more (see test_notify_gate)
    hub.run_until(lambda: len(got) == 30 and not consumer.in_flight, 20)

    assert [body for body, _ in got] == list(range(30))
    assert {name for _, name in got} == {threading.current_thread().name}
    assert set(how) == {"sent"} and len(how) >= 8  # batches of at most 4


@pytest.mark.usefixtures("busy")
def test_a_claim_never_brings_more_than_the_prefetch_window(
    make_connection: Callable[..., Connection], hub: Hub
) -> None:
    conn = _registered(make_connection, hub, "ctw", 20)
    held = _holding(conn, "ctw", 3)

    hub.run_until(lambda: len(held) >= 3, 10)
    for _ in range(20):  # more ticks: nothing else may come while three are unacked
        hub.run_once()

    assert len(held) == 3
    assert conn.transport.consumer.claiming(conn.default_channel) == 0


@pytest.mark.usefixtures("busy")
def test_messages_claimed_for_a_consumer_cancelled_meanwhile_come_back_at_once(
    make_connection: Callable[..., Connection], hub: Hub, store: Store
) -> None:
    conn = _registered(make_connection, hub, "ctc", 5)
    consumer = conn.transport.consumer
    got: list[int] = []
    kombu_consumer = Consumer(
        conn, [Queue("ctc")], callbacks=[lambda b, m: got.append(b)], prefetch_count=10
    )
    kombu_consumer.consume()

    consumer.deliver_pending()  # sends the claim
    kombu_consumer.cancel()
    _take_answer(conn, "ctc")

    assert got == []
    # released, not left leased until the lease ends: claimable right away
    assert len(store.claim("ctc", 10, 1)) == 5


@pytest.mark.usefixtures("busy")
def test_a_wakeup_during_a_short_claim_keeps_the_queue_pending(
    make_connection: Callable[..., Connection], hub: Hub, monkeypatch: pytest.MonkeyPatch
) -> None:
    conn = _registered(make_connection, hub, "ctn", 1)
    consumer = conn.transport.consumer
    got = _consume(conn, "ctn", 10)
    how = _spy_claims(conn, monkeypatch)

    consumer.notice("ctn")
    consumer.deliver_pending()
    # a NOTIFY for a message committed after the claim's snapshot arrives meanwhile
    consumer.notice("ctn")
    _take_answer(conn, "ctn")

    assert got == [0]
    # the short claim did not end the queue's turn: claimed again at once, not left
    # for the safety poll
    assert how == ["sent", "sent"]


@contextmanager
def _locked(dsn: str, schema: str) -> Iterator[psycopg.Connection]:
    """A session holding the message table's strongest lock: claims wait behind it.

    The lock is gone when the block ends: rolled back, not only closed (a closed
    session's server process releases its locks when it gets to it, and a claim sent
    meanwhile, with a statement timeout of 100 ms on a loaded machine, could wait
    for them long enough to be cancelled).
    """
    holder = psycopg.connect(dsn)
    try:
        holder.execute(f'LOCK TABLE "{schema}".message_store IN ACCESS EXCLUSIVE MODE')
        yield holder
        holder.rollback()
    finally:
        holder.close()


@pytest.mark.usefixtures("busy")
def test_a_claim_whose_connection_dies_raises_in_the_loop_and_keeps_the_queue_pending(
    make_connection: Callable[..., Connection], hub: Hub, dsn: str, schema: str, db: Any
) -> None:
    conn = _registered(make_connection, hub, "cte", 1)
    consumer = conn.transport.consumer
    Consumer(conn, [Queue("cte")], callbacks=[lambda b, m: m.ack()]).consume()
    claimer = consumer.claimer
    assert claimer is not None
    with _locked(dsn, schema):
        consumer.notice("cte")
        consumer.deliver_pending()  # the claim waits for the lock, in the database
        assert "cte" in consumer.in_flight
        db.execute("SELECT pg_terminate_backend(%s)", (claimer.backend_pid,))
        _claim_returned(conn)

    with pytest.raises(psycopg.OperationalError, match="administrator command"):
        hub.run_until(lambda: False, 5)  # the loop reads the error, then the closed socket
    assert "cte" in consumer.pending  # claimed again after the reconnect
    assert "cte" not in consumer.in_flight
    assert consumer.claiming(conn.default_channel) == 0


@pytest.mark.usefixtures("busy")
def test_a_claim_that_fails_in_the_database_raises_in_the_loop_and_the_next_one_works(
    make_connection: Callable[..., Connection], hub: Hub, dsn: str, schema: str
) -> None:
    conn = make_connection(options="-c statement_timeout=100", **QUIET)
    fill(conn, "ctq", range(2))
    conn.transport.register_with_event_loop(conn.connection, hub)
    consumer = conn.transport.consumer
    got = _consume(conn, "ctq", 1)
    with _locked(dsn, schema):
        consumer.notice("ctq")
        consumer.deliver_pending()
        # the whole answer: the error comes first, its end after (see the next test)
        with pytest.raises(psycopg.errors.QueryCanceled):  # the statement timeout's
            _take_answer(conn, "ctq")
    assert got == [] and consumer.in_flight == frozenset()
    assert "ctq" in consumer.pending

    hub.run_until(lambda: got == [0, 1], 10)  # the same connection claims again
    assert got == [0, 1]


@pytest.mark.usefixtures("busy")
def test_a_claim_error_read_before_the_end_of_its_answer_is_raised_when_the_answer_ends(
    hub: Hub, dsn: str, schema: str, url_with: Callable[..., str], transport_options: Any
) -> None:
    # The test above once failed with DID NOT RAISE under load: it read the answer once,
    # when the socket turned readable, and the server flushes an ErrorResponse before
    # the ReadyForQuery that ends the answer. Here the end is held back on purpose.
    proxy = AnswerSplitter(dsn)
    conn = Connection(
        url_with(host="127.0.0.1", port=str(proxy.port)),
        transport_options={
            **transport_options,
            **QUIET,
            "sslmode": "disable",
            "gssencmode": "disable",
            "options": "-c statement_timeout=100",
        },
    )
    try:
        fill(conn, "ctp", range(1))
        conn.transport.register_with_event_loop(conn.connection, hub)
        consumer = conn.transport.consumer
        claimer = consumer.claimer
        assert claimer is not None
        got = _consume(conn, "ctp", 1)
        proxy.hold_ready_for(claimer.backend_pid)
        with _locked(dsn, schema):
            consumer.notice("ctp")
            consumer.deliver_pending()
            assert proxy.holding.wait(10), "the claim's answer never ended"
            _claim_returned(conn)  # readable: the error is in, its end is not

            consumer.on_claimed()  # nothing to raise or deliver yet: the claim goes on
            assert "ctp" in consumer.in_flight

            proxy.release()
            with pytest.raises(psycopg.errors.QueryCanceled):
                _take_answer(conn, "ctp")
        assert consumer.in_flight == frozenset() and "ctp" in consumer.pending

        hub.run_until(lambda: got == [0], 10)  # and the connection is usable
        assert got == [0]
    finally:
        conn.release()
        proxy.close()


@pytest.mark.usefixtures("busy")
def test_a_claim_in_flight_when_the_claimer_closes_is_released_at_once(
    make_connection: Callable[..., Connection], hub: Hub, store: Store
) -> None:
    conn = _registered(make_connection, hub, "ctz", 5)
    consumer = conn.transport.consumer
    got = _consume(conn, "ctz", 10, ack=False)

    consumer.notice("ctz")
    consumer.deliver_pending()
    assert "ctz" in consumer.in_flight
    conn.transport.unregister_from_event_loop(conn.connection, hub)  # a worker stops

    assert got == []
    # the claim was awaited and what it leased released: claimable right away
    assert len(store.claim("ctz", 10, 1)) == 5


@pytest.mark.usefixtures("busy")
def test_a_claim_in_the_loop_that_dead_letters_a_message_out_of_attempts_says_so(
    make_connection: Callable[..., Connection], hub: Hub, caplog: pytest.LogCaptureFixture
) -> None:
    first = make_connection(max_attempts=1)
    Producer(first).publish(
        "x", routing_key="ctd", declare=[Queue("ctd")], headers={"task": "t", "id": "i"}
    )
    Producer(first).publish("y", routing_key="ctd")
    channel = first.channel()
    held = channel.basic_get("ctd")
    assert held is not None
    channel.close()  # delivered once, never acked: that delivery counts
    conn = make_connection(max_attempts=1, **QUIET)
    conn.transport.register_with_event_loop(conn.connection, hub)
    consumer = conn.transport.consumer
    got = _consume(conn, "ctd", 10)

    with caplog.at_level(logging.WARNING, logger="kombu_pgqueue"):
        consumer.notice("ctd")
        consumer.deliver_pending()
        assert "ctd" in consumer.in_flight  # sent: the claimer reads the answer
        _take_answer(conn, "ctd")

    assert got == ["y"]
    [line] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    message_id = held.delivery_info["pgqueue_id"]
    assert f"message {message_id} of queue 'ctd' (task t[i])" in line
    assert f"pgqueue dead show {message_id}" in line


@pytest.mark.usefixtures("busy")
def test_claims_without_prepared_statements_deliver_too(
    make_connection: Callable[..., Connection], hub: Hub, monkeypatch: pytest.MonkeyPatch
) -> None:
    # prepare_threshold None is the setting behind PgBouncer in transaction mode
    conn = make_connection(prepare_threshold=None, **QUIET)
    fill(conn, "ctu", range(10))
    conn.transport.register_with_event_loop(conn.connection, hub)
    how = _spy_claims(conn, monkeypatch)
    got = _consume(conn, "ctu", 4)

    hub.run_until(lambda: len(got) == 10, 10)

    assert got == list(range(10))
    assert set(how) == {"sent"}
    claimer = conn.transport.consumer.claimer
    assert claimer is not None
    with psycopg.connect(conn.transport.store.conninfo) as check:
        # nothing was prepared in the claimer's session
        pid = claimer.backend_pid
        assert check.execute("SELECT pid FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone()
    assert claimer.prepared == frozenset()


@pytest.mark.usefixtures("busy")
def test_a_callback_error_mid_batch_releases_the_rest_of_the_batch(
    make_connection: Callable[..., Connection], hub: Hub, store: Store
) -> None:
    conn, got = _failing_on_second(make_connection, hub, "ctx", 5)
    consumer = conn.transport.consumer
    consumer.deliver_pending()  # one batch of 5, sent

    with pytest.raises(RuntimeError):
        _take_answer(conn, "ctx")

    assert got == [0, 1]
    # 2, 3 and 4 were claimed but never handed out: released, claimable at once
    assert sorted(bytes(row.body) for row in store.claim("ctx", 10, 1)) == [b"2", b"3", b"4"]
    assert "ctx" not in consumer.in_flight


def test_a_callback_error_in_an_idle_consumers_inline_claim_releases_the_rest(
    make_connection: Callable[..., Connection], hub: Hub, store: Store
) -> None:
    conn, got = _failing_on_second(make_connection, hub, "ctxi", 5)
    consumer = conn.transport.consumer

    with pytest.raises(RuntimeError):
        consumer.deliver_pending()  # idle: claims all 5 in this thread

    assert got == [0, 1]
    assert consumer.in_flight == frozenset()
    assert sorted(bytes(row.body) for row in store.claim("ctxi", 10, 1)) == [b"2", b"3", b"4"]


@pytest.mark.usefixtures("busy")
def test_a_callback_error_dead_letters_that_message_and_the_batch_goes_on(
    make_connection: Callable[..., Connection],
    hub: Hub,
    store: Store,
    caplog: pytest.LogCaptureFixture,
) -> None:
    conn, got = _failing_on_second(make_connection, hub, "ctdl", 5, "dead_letter")
    consumer = conn.transport.consumer
    consumer.deliver_pending()  # one batch of 5, sent

    with caplog.at_level(logging.ERROR, logger="kombu_pgqueue"):
        _take_answer(conn, "ctdl")  # no error out of the loop

    assert got == [0, 1, 2, 3, 4]
    [dead] = store.dead_letters("ctdl")
    assert (bytes(dead.body), dead.reason) == (b"1", "consumer_error")
    assert dead.error == "RuntimeError: the consumer's callback failed"
    assert f"on message {dead.id} of queue 'ctdl'" in caplog.text
    # the others stay held (the callback did not ack them), the dead one is not
    assert consumer.settler.holding() == 4
    assert conn.default_channel.qos.can_consume_max_estimate() == 1  # Kombu's count too


def test_an_inline_claim_dead_letters_the_failing_message_and_delivers_the_rest(
    make_connection: Callable[..., Connection], hub: Hub, store: Store
) -> None:
    conn, got = _failing_on_second(make_connection, hub, "ctdli", 5, "dead_letter")

    conn.transport.consumer.deliver_pending()  # idle: claims all 5 in this thread

    assert got == [0, 1, 2, 3, 4]
    assert [bytes(d.body) for d in store.dead_letters("ctdli")] == [b"1"]


@pytest.mark.usefixtures("busy")
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
    make_connection: Callable[..., Connection], hub: Hub, monkeypatch: pytest.MonkeyPatch
) -> None:
    conn = _registered(make_connection, hub, "cti", 0, handoff=False)  # it claims
    consumer = conn.transport.consumer
    how = _spy_claims(conn, monkeypatch)
    got: list[int] = []
    Consumer(
        conn,
        [Queue("cti")],
        callbacks=[lambda body, m: (got.append(body), m.ack())],
        prefetch_count=4,
    ).consume()
    # the first tick claims (sent, see below) and finds nothing
    hub.run_until(lambda: bool(how) and not consumer.in_flight, 10)
    del how[:]
    fill(conn, "cti", range(30))  # the NOTIFY wakes the idle consumer through its LISTEN socket

    hub.run_until(lambda: len(got) == 30, 20)

    assert got == list(range(30))
    # the first claim found the consumer idle; later ones came while it held messages
    assert how[0] == "waited"
    assert "sent" in how[1:]


def test_a_tick_callback_never_claims_inline_even_for_an_idle_consumer(
    make_connection: Callable[..., Connection], hub: Hub, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Celery's prefork pool schedules the writes of the tasks handed to it in a tick
    # callback of its own; a task handed over from a tick callback that runs after it
    # waited for the next tick, seconds away (chaos listenkill, 2026-11-24)
    conn = _registered(make_connection, hub, "ctt", 1)
    how = _spy_claims(conn, monkeypatch)
    got = _consume(conn, "ctt", 4)

    for tick in list(hub.on_tick):  # the first tick: its safety poll finds the message
        tick()

    assert got == []  # nothing was handed out from within the tick
    hub.run_until(lambda: got == [0], 10)
    assert got == [0]
    assert how == ["sent"]


@pytest.mark.usefixtures("busy")
def test_a_claim_session_ended_while_idle_raises_in_the_loop_instead_of_spinning(
    make_connection: Callable[..., Connection], hub: Hub, db: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    conn = _registered(make_connection, hub, "cts", 0)
    consumer = conn.transport.consumer
    Consumer(conn, [Queue("cts")], callbacks=[lambda b, m: m.ack()]).consume()
    hub.run_until(lambda: not consumer.in_flight and "cts" not in consumer.pending, 5)
    claimer = consumer.claimer
    assert claimer is not None
    reads: list[int] = []
    results = claimer.results

    def counting() -> Any:
        reads.append(1)
        return results()

    monkeypatch.setattr(claimer, "results", counting)
    db.execute("SELECT pg_terminate_backend(%s)", (claimer.backend_pid,))
    _claim_returned(conn)  # readable: the server's goodbye

    with pytest.raises(psycopg.OperationalError):
        hub.run_until(lambda: False, 5)
    assert 1 <= len(reads) <= 2  # the first read raised (or the second, after the error)


@pytest.mark.usefixtures("busy")
@pytest.mark.parametrize("slow_claim", [0.1, 0.0])
def test_only_time_in_the_server_counts_a_claim_as_slow_not_a_busy_loop(
    make_connection: Callable[..., Connection], hub: Hub, slow_claim: float
) -> None:
    # a slow claim (a long walk over acked rows at the head) makes the consumer resume
    # after its last message for a while; a loop that was busy when the answer came
    # must not, or priorities and requeues would wait for nothing
    conn = _registered(make_connection, hub, "ctslow", 4, slow_claim_seconds=slow_claim)
    consumer = conn.transport.consumer
    clock = consumer.clock
    held = _holding(conn, "ctslow", 1)

    consumer.notice("ctslow")
    consumer.deliver_pending()
    _claim_returned(conn)  # the answer waits in the socket...
    clock.advance(0.3)  # ...while the loop is busy elsewhere for 0.3 s
    _take_answer(conn, "ctslow")
    assert [m.payload for m in held] == [0]
    position = consumer.resume_position("ctslow")
    if slow_claim:
        # the claim took well under 0.1 s in the server: the 0.3 s do not count
        assert position is None
    else:
        # the same claim with any time in the server counting as slow: it resumes
        assert position is not None and position[1] == held[0].delivery_info["pgqueue_id"]
        assert position[2] > clock()


@pytest.mark.usefixtures("busy")
def test_a_resumed_consumer_sends_a_claim_of_the_higher_priorities_when_it_is_due(
    make_connection: Callable[..., Connection], hub: Hub
) -> None:
    conn = _registered(make_connection, hub, "ctabove", 12, **ALWAYS_RESUMED)
    consumer = conn.transport.consumer
    clock = consumer.clock
    held = _holding(conn, "ctabove", 4)
    consumer.notice("ctabove")
    consumer.deliver_pending()
    _take_answer(conn, "ctabove")
    assert [m.payload for m in held] == [0, 1, 2, 3]  # the window is full
    assert consumer.resume_position("ctabove") is not None
    Producer(conn).publish("high", routing_key="ctabove", priority=9)

    clock.advance(_pacing.ABOVE_SECONDS)
    for message in held:
        message.ack()
    del held[:]
    consumer.notice("ctabove")
    consumer.deliver_pending()
    _take_answer(conn, "ctabove")
    # the claim above the position came first, and the queue's own range right after
    assert [m.payload for m in held] == ["high", 4, 5, 6]
    assert consumer.resume_position("ctabove") is not None


def test_a_queue_consumed_without_acks_is_taken_from_again_only_after_news(
    make_connection: Callable[..., Connection], hub: Hub, monkeypatch: pytest.MonkeyPatch
) -> None:
    conn = _registered(make_connection, hub, "ctnoack", 2)
    consumer = conn.transport.consumer
    takes: list[str] = []
    take = consumer.store.take

    def counted(queue: str, limit: int) -> Any:
        takes.append(queue)
        return take(queue, limit)

    monkeypatch.setattr(consumer.store, "take", counted)
    got: list[Any] = []
    kombu_consumer = Consumer(
        conn, [Queue("ctnoack")], callbacks=[lambda b, m: got.append(b)], no_ack=True
    )
    kombu_consumer.consume()
    hub.run_until(lambda: len(got) == 2, 10)
    end = time.monotonic() + 1
    while time.monotonic() < end:  # the loop turns for a second, nothing new in the queue
        hub.run_once()
    # the take that found it drained was the last: a wakeup or the poll says when to look
    assert len(takes) <= 3, takes
