"""Handoff: a publish leases its message to a consumer that waits for the queue, and the
NOTIFY carries it, so that consumer delivers it without a claim round trip.

Every guarantee of a claimed message holds for a handed-off one: its lease is renewed and
fences its ack, it counts against max_attempts, and if its consumer dies the lease ends
and it is claimed again. A consumer that cannot take it then (its window full, the queue
no longer consumed) hands it back at once, and a waiting consumer claims it: no safety
poll (every worker here polls once an hour).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from typing import Any

import psycopg
import pytest
from helpers import counter
from kombu import Connection, Consumer, Producer, Queue
from kombu.message import Message
from waiting import wait_for

from kombu_pgqueue._handoffs import handoff_fits
from kombu_pgqueue._store import new_lease
from kombu_pgqueue.records import Outgoing

HOUR = 3600


def _counts(queue: str) -> dict[str, int]:
    events = ("handoffs", "handbacks", "claimed", "empty_claims")
    return {event: counter(event, queue) for event in events}


def _since(before: dict[str, int], queue: str) -> dict[str, int]:
    return {event: counter(event, queue) - n for event, n in before.items()}


def _row(db: psycopg.Connection, schema: str, queue: str) -> tuple[Any, ...] | None:
    return db.execute(
        f'SELECT id, lease, attempts FROM "{schema}".message_store WHERE queue = %s',  # noqa: S608
        [queue],
    ).fetchone()


def _settle(worker: Connection) -> None:
    """The claim every new subscription starts with (it finds the queue empty)."""
    worker.transport.consumer.deliver_pending(inline=True)


def _waiting_in_loop(
    make_connection: Callable[..., Connection],
    hub: Any,
    queue: str,
    prefetch: int,
    callback: Callable[[Any, Message], object],
) -> Connection:
    """A worker in ``hub``'s event loop consuming ``queue`` within a window of
    ``prefetch``, after its first claim (it found the queue empty and waits for
    publishes); no safety poll within the test (an hour)."""
    worker = make_connection(polling_interval=HOUR)
    worker.transport.register_with_event_loop(worker.connection, hub)
    Consumer(worker, [Queue(queue)], callbacks=[callback], prefetch_count=prefetch).consume()
    hub.run_until(lambda: queue not in worker.transport.consumer.pending, 10, "the first claim")
    return worker


@contextmanager
def _one_handoff(worker: Connection, connection: Connection) -> Iterator[list[Message]]:
    """``worker`` consumes queue "h" and waits; one message ("x") published then is
    handed off to it and delivered. Yields the messages it got, still consuming."""
    got: list[Message] = []
    with Consumer(worker, [Queue("h")], callbacks=[lambda body, message: got.append(message)]):
        _settle(worker)
        before = _counts("h")
        Producer(connection).publish("x", routing_key="h")
        worker.drain_events(timeout=10)
        assert _since(before, "h")["handoffs"] == 1
        yield got


def test_a_waiting_consumer_gets_a_message_without_a_claim(
    connection: Connection, make_connection: Callable[..., Connection], db, schema: str
) -> None:
    worker = make_connection(polling_interval=HOUR)
    got: list[Message] = []
    with Consumer(worker, [Queue("h")], callbacks=[lambda body, message: got.append(message)]):
        _settle(worker)
        before = _counts("h")
        Producer(connection).publish({"n": 1}, routing_key="h", priority=3)
        worker.drain_events(timeout=10)

        assert [m.decode() for m in got] == [{"n": 1}]
        assert _since(before, "h") == {
            "handoffs": 1,
            "handbacks": 0,
            "claimed": 0,
            "empty_claims": 0,
        }
        info = got[0].delivery_info
        assert info["pgqueue_attempts"] == 1 and not info["redelivered"]
        assert info["pgqueue_handoff"] is True
        assert got[0].properties["priority"] == 3
        row = _row(db, schema, "h")
        assert row is not None and row[2] == 1  # leased as a claim would
        assert got[0].delivery_tag == f"{row[0]}.{row[1]}"  # tagged with that lease
        got[0].ack()
        assert _row(db, schema, "h") is None


def test_the_ack_of_a_handoff_is_fenced_by_its_lease(
    connection: Connection, make_connection: Callable[..., Connection], db, schema, store, later
) -> None:
    worker = make_connection(polling_interval=HOUR, visibility_timeout=30)
    with _one_handoff(worker, connection) as got:
        row = _row(db, schema, "h")
        assert row is not None
        assert store.claim("h", 1, new_lease()) == []  # leased: no claim takes it
        assert not store.ack(row[0], row[1] + 1)  # another lease cannot ack it
        # the lease ended (the consumer looked dead): claimed again, with a new lease
        again = store.claim("h", 1, new_lease(), now=later(31))
        assert [m.id for m in again] == [row[0]] and again[0].attempts == 2
        got[0].ack()  # the old delivery's ack deletes nothing
        assert _row(db, schema, "h") is not None


def test_a_consumer_that_cannot_take_a_handoff_hands_it_back_to_one_that_can(
    connection: Connection, make_connection: Callable[..., Connection], db, schema: str
) -> None:
    """The consumer picked is the only waiter, its window full by another queue; the
    other consumer watches the queue without taking handoffs, and claims it at once."""
    producer = Producer(connection)
    producer.publish("busy", routing_key="other")
    full = make_connection(polling_interval=HOUR)
    idle = make_connection(polling_interval=HOUR, handoff=False)
    held: list[Message] = []
    got: list[Message] = []
    full.default_channel.basic_qos(0, 1, False)
    with (
        Consumer(full, [Queue("h"), Queue("other")], callbacks=[lambda b, m: held.append(m)]),
        Consumer(idle, [Queue("h")], callbacks=[lambda b, m: got.append(m)]),
    ):
        full.drain_events(timeout=10)
        assert [m.body for m in held] == [b"busy"]  # its window (1) is full
        _settle(full)
        _settle(idle)
        before = _counts("h")
        producer.publish("x", routing_key="h")
        row = _row(db, schema, "h")
        assert row is not None and row[1] is not None  # handed off to `full`

        consumer = full.transport.consumer
        wait_for(lambda: consumer.wakeups.wait(1), 10, "the handoff")
        assert consumer.deliver_pending(inline=True) == 0
        idle.drain_events(timeout=10)

        assert [m.body for m in got] == [b"x"]
        assert got[0].delivery_info["pgqueue_attempts"] == 1  # handing back did not count
        assert "pgqueue_handoff" not in got[0].delivery_info  # claimed
        assert held == [held[0]]
        counted = _since(before, "h")
        assert (counted["handoffs"], counted["handbacks"], counted["claimed"]) == (0, 1, 1)


def test_a_message_handed_to_a_consumer_that_died_comes_back_after_one_lease(
    connection: Connection, make_connection: Callable[..., Connection], db, schema, store, later
) -> None:
    worker = make_connection(polling_interval=HOUR, visibility_timeout=30)
    with Consumer(worker, [Queue("h")], callbacks=[]):
        _settle(worker)
        Producer(connection).publish("x", routing_key="h")
        row = _row(db, schema, "h")
        assert row is not None and row[1] is not None  # handed off, never read: it died
        assert store.claim("h", 1, new_lease(), now=later(29)) == []
        again = store.claim("h", 1, new_lease(), now=later(31))
        assert [m.id for m in again] == [row[0]] and again[0].attempts == 2


def test_a_waiter_whose_session_is_gone_is_not_handed_anything(
    connection: Connection, make_connection: Callable[..., Connection], db, schema: str
) -> None:
    gone = make_connection(polling_interval=HOUR)
    watcher = make_connection(polling_interval=HOUR, handoff=False)
    got: list[Message] = []
    with (
        Consumer(gone, [Queue("h")], callbacks=[]),
        Consumer(watcher, [Queue("h")], callbacks=[lambda b, m: got.append(m)]),
    ):
        _settle(gone)
        _settle(watcher)
        listener = gone.transport.consumer.wakeups.listener
        assert listener is not None
        pid = listener.conn.info.backend_pid
        # its row stays (nobody removed it), its liveness lock went with the session
        db.execute("SELECT pg_terminate_backend(%s)", [pid])
        wait_for(
            lambda: (
                not db.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", [pid]).fetchone()
            ),
            10,
            "the session to end",
        )
        Producer(connection).publish("x", routing_key="h")
        row = _row(db, schema, "h")
        assert row is not None and row[1] is None  # not leased: every consumer woken
        watcher.drain_events(timeout=10)
        assert [m.body for m in got] == [b"x"]


def test_max_attempts_counts_a_handoff_as_a_delivery(
    connection: Connection, make_connection: Callable[..., Connection], db, schema: str
) -> None:
    worker = make_connection(polling_interval=HOUR, max_attempts=2)
    with _one_handoff(worker, connection) as got:
        got[0].requeue()  # attempt 1 (the handoff)
        worker.drain_events(timeout=10)
        assert got[1].delivery_info["pgqueue_attempts"] == 2
        got[1].requeue()  # attempt 2: the next claim dead-letters it
        consumer = worker.transport.consumer
        wait_for(lambda: consumer.wakeups.wait(1), 10, "the requeue's wakeup")
        assert consumer.deliver_pending(inline=True) == 0
        reason = db.execute(f'SELECT reason, attempts FROM "{schema}".dead_letter').fetchone()  # noqa: S608
        assert reason == ("max_attempts", 2)
        assert len(got) == 2


@pytest.mark.parametrize("size, handed", [(5000, True), (6000, False)])
def test_a_message_too_big_for_a_notify_is_claimed_as_before(
    connection: Connection,
    make_connection: Callable[..., Connection],
    size: int,
    handed: bool,
) -> None:
    worker = make_connection(polling_interval=HOUR)
    got: list[Message] = []
    with Consumer(worker, [Queue("h")], callbacks=[lambda body, message: got.append(message)]):
        _settle(worker)
        before = _counts("h")
        body = b"\xff" * size  # base64: 4/3 of it
        Producer(connection).publish(
            body,
            routing_key="h",
            serializer=None,
            content_type="application/data",
            content_encoding="binary",
        )
        worker.drain_events(timeout=10)
        assert [m.body for m in got] == [body]
        counted = _since(before, "h")
        assert (counted["handoffs"], counted["claimed"]) == ((1, 0) if handed else (0, 1))


def test_handoff_fits_counts_the_payload_in_bytes() -> None:
    small = Outgoing(queue="q", body=b"x" * 4000, headers="{}", properties="{}")
    assert handoff_fits(small)
    assert not handoff_fits(Outgoing(queue="q", body=b"x" * 6000, headers="{}", properties="{}"))
    wide = "é" * 1500  # 2 bytes each in UTF-8: 3000 bytes, sealed with the body 9,500
    assert not handoff_fits(Outgoing(queue="q", body=b"x" * 4000, headers=wide, properties="{}"))


def test_a_handoff_read_after_much_of_its_lease_is_handed_back_and_claimed(
    connection: Connection, make_connection: Callable[..., Connection], db, schema: str
) -> None:
    """A handoff read with less of its lease left than one renewal interval leaves (as if
    the consumer's loop was blocked that long) is not delivered on that lease: it could
    end before the lease keeper renews it. Here the lease is made short instead."""
    worker = make_connection(polling_interval=HOUR, visibility_timeout=30)  # renews at 10 s
    got: list[Message] = []
    with Consumer(worker, [Queue("h")], callbacks=[lambda body, message: got.append(message)]):
        _settle(worker)
        db.execute(f'UPDATE "{schema}".listener SET lease_seconds = 5')  # noqa: S608
        before = _counts("h")
        Producer(connection).publish("x", routing_key="h")
        worker.drain_events(timeout=10)

        assert [m.body for m in got] == [b"x"]
        counted = _since(before, "h")
        assert (counted["handoffs"], counted["handbacks"], counted["claimed"]) == (0, 1, 1)
        assert got[0].delivery_info["pgqueue_attempts"] == 1


def test_in_an_event_loop_a_burst_is_handed_off_up_to_the_window_and_claimed_after(
    connection: Connection, make_connection: Callable[..., Connection], hub
) -> None:
    """A worker (prefetch 4, acking four at a time) waits in an event loop; 30 messages
    arrive at once, all handed off to it. It delivers what its window takes, hands back
    the rest at once, and claims them as it acks: each delivered once, none waiting for
    the safety poll."""
    got: list[int] = []
    unacked: list[Message] = []
    _waiting_in_loop(
        make_connection,
        hub,
        "hl",
        4,
        lambda body, message: (got.append(body), unacked.append(message)),
    )
    before = _counts("hl")
    producer = Producer(connection)
    for i in range(30):
        producer.publish(i, routing_key="hl")

    def all_delivered() -> bool:
        if len(unacked) == 4:  # the window is full: ack it
            for message in unacked:
                message.ack()
            unacked.clear()
        return len(got) == 30

    hub.run_until(all_delivered, 20, "30 deliveries")

    assert sorted(got) == list(range(30))
    counted = _since(before, "hl")
    # every one was handed off: delivered as it came (the first window's four at least,
    # more when the notifications come in two reads and an ack opens the window between
    # them) or handed back and then claimed
    assert counted["handoffs"] >= 4
    assert counted["handoffs"] + counted["handbacks"] == 30
    assert counted["claimed"] == counted["handbacks"]


def test_a_window_filled_by_handoffs_is_claimed_again_as_it_opens(
    connection: Connection, make_connection: Callable[..., Connection], hub
) -> None:
    """A worker (prefetch 2) in an event loop is handed two messages, which fill its
    window: it stops waiting for publishes while full. Once it acks them, the next
    message reaches it at once, not at the safety poll (an hour here). Found by Celery's
    own test_expired: a task that expires in 1 s behind four others waited 5 s for the
    poll and was dropped as expired, never revoked by the worker."""
    got: list[Message] = []
    _waiting_in_loop(make_connection, hub, "hw", 2, lambda body, message: got.append(message))
    before = _counts("hw")
    producer = Producer(connection)
    for i in range(2):
        producer.publish(i, routing_key="hw")
    hub.run_until(lambda: len(got) == 2, 10, "two handoffs")
    assert _since(before, "hw")["handoffs"] == 2

    for message in got:
        message.ack()
    producer.publish(2, routing_key="hw")
    hub.run_until(lambda: len(got) == 3, 10, "the message published after the acks")
    assert [m.decode() for m in got] == [0, 1, 2]


def test_a_message_with_a_dedup_key_is_handed_off_and_a_replacement_too(
    connection: Connection, make_connection: Callable[..., Connection], db, schema: str
) -> None:
    """Celery task messages carry a dedup key. A replacement of a waiting message is a new
    message: handed off too, with the new lease."""
    worker = make_connection(polling_interval=HOUR)
    got: list[Message] = []
    producer = Producer(connection)
    later = (datetime.now(timezone.utc) + timedelta(hours=1)).isoformat()
    producer.publish("old", routing_key="h", headers={"dedup_key": "k", "eta": later})
    with Consumer(worker, [Queue("h")], callbacks=[lambda body, message: got.append(message)]):
        _settle(worker)
        before = _counts("h")
        replace = {"dedup_key": "k", "dedup_replace": True}
        producer.publish("new", routing_key="h", headers=replace)  # replaces "old"
        producer.publish("other", routing_key="h", headers={"dedup_key": "k2"})
        while len(got) < 2:
            worker.drain_events(timeout=10)

        assert [m.body for m in got] == [b"new", b"other"]
        assert _since(before, "h")["handoffs"] == 2
        rows = db.execute(
            f'SELECT id, lease, attempts FROM "{schema}".message_store ORDER BY id'  # noqa: S608
        ).fetchall()
        assert [f"{i}.{lease}" for i, lease, _ in rows] == [m.delivery_tag for m in got]
        assert [attempts for _, _, attempts in rows] == [1, 1]
        for message in got:
            message.ack()
        assert _row(db, schema, "h") is None


def test_a_forged_handoff_is_ignored(
    connection: Connection, make_connection: Callable[..., Connection], db, schema: str
) -> None:
    """Any role that may connect may NOTIFY on the channel, and read the consumer's id in
    the handoffs it sees: a handoff not signed with the consumer's secret is not
    delivered (it would run whatever body it carries)."""
    worker = make_connection(polling_interval=HOUR)
    got: list[Message] = []
    with Consumer(worker, [Queue("h")], callbacks=[lambda body, message: got.append(message)]):
        _settle(worker)
        listener = worker.transport.consumer.wakeups.listener
        assert listener is not None
        forged = _forge(listener.consumer, listener.watched["h"])
        db.execute("SELECT pg_notify(%s, %s)", [listener.options.channel, forged])
        Producer(connection).publish("real", routing_key="h")
        while not got:
            worker.drain_events(timeout=10)

        assert [m.body for m in got] == [b"real"]


def _forge(consumer: str, token: str) -> str:
    """A handoff as statement publish writes it, but signed without the secret."""
    return f"h:{consumer}:{'0' * 32}:{token}:999:1:{time.time() + 60}:AAAA"


def test_a_handoff_carries_text_beyond_ascii_intact(
    connection: Connection, make_connection: Callable[..., Connection]
) -> None:
    """Lengths in the sealed message count UTF-8 bytes on both sides: headers,
    properties and content type beyond ASCII arrive as sent."""
    worker = make_connection(polling_interval=HOUR)
    got: list[Message] = []
    with Consumer(worker, [Queue("h")], callbacks=[lambda body, message: got.append(message)]):
        _settle(worker)
        before = _counts("h")
        Producer(connection).publish(
            "☃ body",
            routing_key="h",
            headers={"ünï": "☃:x", "n": 1},
            content_type="text/plain; charset=ütf",
            content_encoding="utf-8",
            serializer=None,
        )
        worker.drain_events(timeout=10)

        assert _since(before, "h")["handoffs"] == 1
        assert got[0].headers == {"ünï": "☃:x", "n": 1}
        assert got[0].content_type == "text/plain; charset=ütf"
        assert got[0].body == "☃ body".encode()
