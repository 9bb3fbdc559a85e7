"""Publish and consume through Kombu: drain_events, Simple*, priority, ack/reject/requeue, TTL."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

import pytest
from kombu import Connection, Consumer, Exchange, Producer, Queue
from kombu.simple import SimpleQueue

from kombu_pgqueue._store import Outgoing, new_lease

Later = Callable[[float], datetime]


def _collect(conn: Connection, queues: list[Queue], **kwargs: Any) -> tuple[Consumer, list[Any]]:
    got: list[Any] = []
    consumer = Consumer(
        conn, queues, callbacks=[lambda body, message: got.append(message)], **kwargs
    )
    consumer.consume()
    return consumer, got


def test_drain_events_delivers_a_published_message(connection: Connection) -> None:
    queue = Queue("tasks", Exchange("work", "direct"), "run")
    consumer, got = _collect(connection, [queue])
    Producer(connection).publish(
        {"task": "add", "args": [2, 2]},
        exchange="work",
        routing_key="run",
        headers={"origin": "ünïcode", "n": 3},
        declare=[queue],
    )

    connection.drain_events(timeout=5)

    [message] = got
    assert message.payload == {"task": "add", "args": [2, 2]}
    assert message.headers == {"origin": "ünïcode", "n": 3}
    assert message.content_type == "application/json"
    assert message.delivery_info["routing_key"] == "run"
    assert message.delivery_info["redelivered"] is False
    message.ack()
    assert connection.default_channel.store.size("tasks") == 0
    consumer.cancel()


def test_drain_events_on_an_empty_queue_raises_socket_timeout(connection: Connection) -> None:
    consumer, got = _collect(connection, [Queue("empty")])
    started = time.monotonic()

    with pytest.raises(socket.timeout):
        connection.drain_events(timeout=0.5)

    assert 0.4 <= time.monotonic() - started < 5
    assert got == []
    consumer.cancel()


def test_simple_queue_put_and_get_in_order(connection: Connection) -> None:
    queue = connection.SimpleQueue("simple")
    for n in range(3):
        queue.put({"n": n})

    assert queue.qsize() == 3
    received = []
    for _ in range(3):
        message = queue.get(timeout=5)
        received.append(message.payload["n"])
        message.ack()

    assert received == [0, 1, 2]
    with pytest.raises(SimpleQueue.Empty):
        queue.get_nowait()
    assert queue.qsize() == 0
    queue.close()


def test_simple_queue_clear_purges_waiting_messages(connection: Connection) -> None:
    queue = connection.SimpleQueue("simple-clear")
    for n in range(4):
        queue.put(n)

    assert queue.clear() == 4
    assert queue.qsize() == 0
    queue.close()


def test_simple_buffer_hands_out_without_ack(connection: Connection) -> None:
    buffer = connection.SimpleBuffer("buffer")
    buffer.put("first")
    buffer.put("second")

    assert buffer.get(timeout=5).payload == "first"
    assert buffer.get(timeout=5).payload == "second"
    # no-ack: gone as handed out, nothing waits or comes back
    store = connection.default_channel.store
    assert store.size("buffer") == 0
    assert store.dead_letters() == []
    with pytest.raises(SimpleQueue.Empty):
        buffer.get(timeout=0.2)
    buffer.close()


def test_claim_delivers_higher_priority_first_fifo_within_in_one_batch(
    connection: Connection,
) -> None:
    queue = Queue("prio", max_priority=10)
    producer = Producer(connection)
    sent = [("low-a", 0), ("mid-a", 5), ("high", 9), ("mid-b", 5), ("low-b", 0), ("top", 10)]
    for body, priority in sent:
        producer.publish(body, routing_key="prio", priority=priority, declare=[queue])
    consumer, got = _collect(connection, [queue])

    connection.drain_events(timeout=5)  # once

    assert [m.payload for m in got] == ["top", "high", "mid-a", "mid-b", "low-a", "low-b"]
    for message in got:
        message.ack()
    consumer.cancel()


def _backlog(conn: Connection, name: str, n: int, prefetch: int) -> tuple[Consumer, list[Any]]:
    """Publish 0..n-1 to queue ``name``, then consume it with a prefetch window."""
    queue = Queue(name)
    producer = Producer(conn)
    for k in range(n):
        producer.publish(k, routing_key=name, declare=[queue])
    return _collect(conn, [queue], prefetch_count=prefetch)


def test_basic_qos_prefetch_limits_the_batch(connection: Connection) -> None:
    consumer, got = _backlog(connection, "prefetch", 5, prefetch=2)

    connection.drain_events(timeout=5)
    assert [m.payload for m in got] == [0, 1]
    with pytest.raises(socket.timeout):
        connection.drain_events(timeout=0.3)  # window full until an ack

    got[0].ack()
    connection.drain_events(timeout=5)
    assert [m.payload for m in got] == [0, 1, 2]
    for message in got[1:]:
        message.ack()
    consumer.cancel()


def test_batch_limit_waits_until_at_most_a_quarter_of_the_window_is_held(
    connection: Connection,
) -> None:
    consumer = connection.transport.consumer
    consumer.clock.freeze()  # the claims below happen "just now"
    kombu_consumer, got = _backlog(connection, "quarter", 12, prefetch=8)
    connection.drain_events(timeout=5)
    assert len(got) == 8
    channel = connection.default_channel

    for message in got[:5]:
        message.ack()
    assert consumer.batch_limit(channel) == 0  # 3 of 8 held: more than a quarter
    consumer.clock.advance(1)  # the last claim was long ago: no more waiting
    assert consumer.batch_limit(channel) == 5
    consumer.clock.advance(-1)
    got[5].ack()
    assert consumer.batch_limit(channel) == 6  # 2 of 8 held: claim the 6 free slots at once
    got[6].ack()
    channel.basic_qos(prefetch_count=2)
    assert consumer.batch_limit(channel) == 1  # one held of a window of 2: never waits for it
    got[7].ack()
    kombu_consumer.cancel()


def test_basic_ack_deletes_the_message_for_good(connection: Connection, later: Later) -> None:
    queue = connection.SimpleQueue("acked")
    queue.put("once")

    queue.get(timeout=5).ack()

    store = connection.default_channel.store
    assert store.size("acked", now=later(3600)) == 0
    assert store.claim("acked", 10, new_lease(), now=later(3600)) == []
    queue.close()


def test_basic_reject_without_requeue_dead_letters_as_rejected(connection: Connection) -> None:
    queue = connection.SimpleQueue("rejects")
    queue.put({"bad": True})

    message = queue.get(timeout=5)
    message.reject(requeue=False)

    store = connection.default_channel.store
    [dead] = store.dead_letters("rejects")
    assert dead.reason == "rejected"
    assert dead.id == message.delivery_info["pgqueue_id"]
    assert dead.attempts == 1
    assert store.size("rejects") == 0
    with pytest.raises(SimpleQueue.Empty):
        queue.get(timeout=0.2)
    assert dead.error is None  # rejected outside an except block: nothing says why


def test_a_reject_inside_an_except_block_keeps_the_exception_as_the_error(
    connection: Connection,
) -> None:
    queue = connection.SimpleQueue("rejected-why")
    queue.put({"kind": "unknown"})
    message = queue.get(timeout=5)

    handlers = {"known": print}
    try:
        handlers[message.payload["kind"]]
    except KeyError:
        message.reject(requeue=False)

    [dead] = connection.default_channel.store.dead_letters("rejected-why")
    assert (dead.reason, dead.error) == ("rejected", "KeyError: 'unknown'")
    queue.close()
    queue.close()


def test_basic_reject_with_requeue_is_visible_at_once_and_redelivered(
    connection: Connection, make_connection: Callable[..., Connection]
) -> None:
    queue = connection.SimpleQueue("requeued")
    queue.put("again")
    first = queue.get(timeout=5)
    assert first.delivery_info["redelivered"] is False

    first.requeue()

    other = make_connection()
    again = other.default_channel.basic_get("requeued")  # no waiting, no time moved
    assert again is not None
    assert again.payload == "again"
    assert again.delivery_info["redelivered"] is True
    assert again.delivery_info["pgqueue_attempts"] == 2
    again.ack()
    queue.close()


def test_requeued_message_comes_back_to_the_same_consumer(connection: Connection) -> None:
    queue = Queue("requeue-self")
    Producer(connection).publish("x", routing_key="requeue-self", declare=[queue])
    consumer, got = _collect(connection, [queue])
    connection.drain_events(timeout=5)

    got[0].requeue()
    connection.drain_events(timeout=5)

    assert [m.payload for m in got] == ["x", "x"]
    assert got[1].delivery_info["redelivered"] is True
    got[1].ack()
    consumer.cancel()


def test_max_attempts_dead_letters_after_repeated_requeues(
    make_connection: Callable[..., Connection],
) -> None:
    conn = make_connection(max_attempts=2)
    channel = conn.default_channel
    conn.SimpleQueue("attempts").put("poison")

    first = channel.basic_get("attempts")
    first.requeue()
    second = channel.basic_get("attempts")
    assert second.delivery_info["redelivered"] is True
    second.requeue()

    assert channel.basic_get("attempts") is None
    [dead] = channel.store.dead_letters("attempts")
    assert (dead.reason, dead.attempts, dead.id) == (
        "max_attempts",
        2,
        first.delivery_info["pgqueue_id"],
    )


def test_message_expiration_is_not_delivered_after_it_expired(
    connection: Connection, later: Later
) -> None:
    queue = Queue("expiring")
    Producer(connection).publish(
        "short-lived", routing_key="expiring", expiration=30, declare=[queue]
    )
    store = connection.default_channel.store

    assert store.claim("expiring", 10, new_lease(), now=later(31)) == []
    assert store.sweep(now=later(31))["expired_messages"] == 1
    assert store.size("expiring") == 0


def test_message_expiration_still_delivered_before_it_expires(
    connection: Connection, later: Later
) -> None:
    queue = Queue("expiring-ok")
    Producer(connection).publish("fresh", routing_key="expiring-ok", expiration=30, declare=[queue])
    store = connection.default_channel.store

    [delivered] = store.claim("expiring-ok", 10, new_lease(), now=later(29))
    assert bytes(delivered.body) == b"fresh"


def test_message_expiration_zero_is_never_delivered(connection: Connection) -> None:
    queue = Queue("expired-at-once")
    consumer, got = _collect(connection, [queue])
    Producer(connection).publish(
        "gone", routing_key="expired-at-once", expiration=0, declare=[queue]
    )
    Producer(connection).publish("kept", routing_key="expired-at-once", declare=[queue])

    connection.drain_events(timeout=5)

    assert [m.payload for m in got] == ["kept"]
    assert "expiration" not in got[0].properties
    got[0].ack()
    consumer.cancel()


def test_queue_message_ttl_expires_messages(connection: Connection, later: Later) -> None:
    queue = Queue("ttl-queue", message_ttl=30)
    producer = Producer(connection)
    producer.publish("a", routing_key="ttl-queue", declare=[queue])
    store = connection.default_channel.store

    assert store.claim("ttl-queue", 10, new_lease(), now=later(31)) == []
    assert len(store.claim("ttl-queue", 10, new_lease(), now=later(29))) == 1


def test_queue_expires_sweep_removes_the_unused_queue(connection: Connection, later: Later) -> None:
    exchange = Exchange("temp-ex", "direct")
    queue = Queue("temp-queue", exchange, "temp", expires=1)
    queue(connection.default_channel).declare()
    Producer(connection).publish("left behind", exchange=exchange, routing_key="temp")
    store = connection.default_channel.store
    assert store.queue_exists("temp-queue")

    swept = store.sweep(now=later(31))  # x-expires counts at least 30 s (min_expires)

    assert swept["expired_queues"] == 1
    assert swept["queue_messages"] == 1
    assert not store.queue_exists("temp-queue")
    assert (
        store.publish_routed(
            "temp-ex", "temp", Outgoing(queue="", body=b"", headers="{}", properties="{}")
        )
        is None  # its binding went with it: unroutable
    )


def test_queue_declare_reports_the_message_count(connection: Connection) -> None:
    queue = connection.SimpleQueue("counted")
    for n in range(3):
        queue.put(n)

    declared = Queue("counted")(connection.default_channel).declare()

    assert declared == "counted"
    ok = connection.default_channel.queue_declare("counted", passive=True)
    assert ok.message_count == 3
    queue.close()


def test_queue_purge_and_delete(connection: Connection) -> None:
    channel = connection.default_channel
    bound = Queue("doomed", Exchange("doomed-ex", "fanout"))(channel)
    bound.declare()
    for n in range(3):
        Producer(channel).publish(n, exchange="doomed-ex")

    assert bound.purge() == 3
    Producer(channel).publish("one more", exchange="doomed-ex")
    bound.delete()

    assert not channel.store.queue_exists("doomed")
    assert channel.store.bindings("doomed-ex") == []


def test_no_ack_consumer_takes_messages_without_ack(connection: Connection) -> None:
    queue = Queue("noack")
    for n in range(3):
        Producer(connection).publish(n, routing_key="noack", declare=[queue])
    consumer, got = _collect(connection, [queue], no_ack=True)

    connection.drain_events(timeout=5)

    assert [m.payload for m in got] == [0, 1, 2]
    store = connection.default_channel.store
    assert store.size("noack") == 0
    consumer.cancel()
    connection.release()  # nothing held, so nothing is handed back
    assert store.size("noack") == 0
    assert store.dead_letters() == []


def test_eta_in_the_past_is_delivered_at_once(connection: Connection) -> None:
    queue = Queue("eta-past")
    consumer, got = _collect(connection, [queue])
    Producer(connection).publish(
        "due",
        routing_key="eta-past",
        headers={"eta": "2000-01-01T00:00:00+00:00"},
        declare=[queue],
    )

    connection.drain_events(timeout=5)

    assert [m.payload for m in got] == ["due"]
    got[0].ack()
    consumer.cancel()


def test_a_channel_that_stops_consuming_leaves_no_claim_state_behind(
    connection: Connection,
) -> None:
    consumer = connection.transport.consumer
    got: list[Any] = []
    for n in range(3):
        channel = connection.channel()
        queue = Queue(f"gone{n}")
        Producer(channel).publish(n, routing_key=queue.name, declare=[queue])
        kombu_consumer = Consumer(channel, [queue], callbacks=[lambda b, m: got.append(m)])
        kombu_consumer.consume()
        connection.drain_events(timeout=5)
        got[-1].ack()
        assert consumer.channels() == 1  # the channel's claims are paced while it consumes
        kombu_consumer.cancel()
        channel.close()
    assert consumer.channels() == 0
