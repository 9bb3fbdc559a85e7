"""Bulk publishing: many messages, one statement, every one delivered once."""

from __future__ import annotations

from kombu import Consumer, Queue
from psycopg import sql

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


def _row(queue: str, key: str | None, eta=None, body: bytes = b"{}") -> tuple:
    return (queue, 0, eta, None, key, body, "application/json", "utf-8", "{}", "{}")


def test_a_taken_key_is_skipped_by_the_direct_copy(store, db):
    """A COPY straight into the queue skips a row whose key a waiting message holds,
    and counts only the rows that went in."""
    assert store.publish_rows([_row("mix", "k1"), _row("mix", "k3")]) == 2
    batch = [_row("mix", f"k{i}", body=f'{{"i": {i}}}'.encode()) for i in range(6)]
    assert store.publish_rows(batch) == 4  # k1 and k3 were waiting
    assert store.size("mix") == 6
    keys = db.execute(
        sql.SQL("SELECT dedup_key FROM {}.message_store ORDER BY id").format(
            sql.Identifier(store.schema)
        )
    ).fetchall()
    assert [k for (k,) in keys] == ["k1", "k3", "k0", "k2", "k4", "k5"]


def test_eta_rows_and_ttl_queues_take_the_staging_way(store, db, later, connection):
    """An ETA row stays delayed, and a queue's x-message-ttl still caps expires_at."""
    Queue("short", queue_arguments={"x-message-ttl": 60_000})(connection.default_channel).declare()
    due = later(3600)
    rows = [_row("short", None), _row("plain", None), _row("plain", None, eta=due)]
    assert store.publish_rows(rows) == 3
    query = "SELECT queue, delayed, next_iteration, expires_at IS NOT NULL FROM {}.message_store"
    found = db.execute(
        sql.SQL(query + " ORDER BY queue, delayed").format(sql.Identifier(store.schema))
    ).fetchall()
    assert [(q, d, e) for q, d, _, e in found] == [
        ("plain", False, False),
        ("plain", True, False),
        ("short", False, True),
    ]
    assert found[1][2] == due
