"""Bulk publishing: many messages, one statement, every one delivered once."""

from __future__ import annotations

from kombu import Consumer, Queue

from kombu_pgqueue.bulk import publish_many


def test_publish_many_delivers_every_message_once(connection, store):
    assert (
        publish_many(connection, ({"n": i} for i in range(12_345)), "bulk", batch_size=5000)
        == 12_345
    )
    assert store.size("bulk") == 12_345
    seen: list[int] = []

    def on_message(body, message):
        seen.append(body["n"])
        message.ack()

    with Consumer(connection, [Queue("bulk")], callbacks=[on_message], prefetch_count=500):
        while len(seen) < 12_345:
            connection.drain_events(timeout=5)
    assert sorted(seen) == list(range(12_345))
    assert store.size("bulk") == 0


def test_publish_many_wakes_a_waiting_consumer(connection, make_connection):
    other = make_connection(polling_interval=60)
    got: list[dict] = []
    with Consumer(other, [Queue("woken")], callbacks=[lambda b, m: (got.append(b), m.ack())]):
        publish_many(connection, [{"a": 1}, {"a": 2}], "woken")
        other.drain_events(timeout=10)  # wakes on NOTIFY; the poll is 60 s away
    assert got == [{"a": 1}, {"a": 2}]
