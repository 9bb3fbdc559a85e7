"""Batched acks (the default): one DELETE per batch, and a transport reads its own acks."""

from __future__ import annotations

import threading

from kombu import Consumer, Queue
from psycopg import sql
from waiting import wait_for

from kombu_pgqueue.bulk import publish_many


def _rows(db, schema: str) -> int:
    query = sql.SQL("SELECT count(*) FROM {}.message").format(sql.Identifier(schema))
    return db.execute(query).fetchone()[0]


def test_acked_messages_leave_the_table(make_connection, db, schema):
    conn = make_connection(batch_acks=True)
    publish_many(conn, range(500), "acks")
    seen: list[int] = []
    with Consumer(
        conn, [Queue("acks")], callbacks=[lambda b, m: (seen.append(b), m.ack())], prefetch_count=50
    ):
        while len(seen) < 500:
            conn.drain_events(timeout=5)
        # the same transport sees its own acks at once
        assert conn.default_channel._size("acks") == 0
    assert sorted(seen) == list(range(500))
    conn.release()  # close flushes whatever is pending
    assert _rows(db, schema) == 0


def test_acks_from_another_thread_are_sent(make_connection, db, schema):
    conn = make_connection(batch_acks=True)
    publish_many(conn, range(20), "acks2")
    got = []
    with Consumer(
        conn, [Queue("acks2")], callbacks=[lambda b, m: got.append(m)], prefetch_count=20
    ):
        conn.drain_events(timeout=5)
        assert len(got) == 20
        acker = threading.Thread(target=lambda: [m.ack() for m in got])
        acker.start()
        acker.join()
        # nobody on this transport reads again: the background flusher must send them
        wait_for(lambda: _rows(db, schema) == 0, 5, "the background flusher to send the acks")


def test_a_stale_batched_ack_does_not_delete_a_newer_delivery(make_connection, store, db, schema):
    conn = make_connection(batch_acks=True)
    publish_many(conn, ["x"], "stale")
    message = conn.default_channel.basic_get("stale")
    assert message is not None
    # the lease lapses and another consumer claims the message
    ident = sql.Identifier(schema)
    db.execute(
        sql.SQL("UPDATE {}.message SET next_iteration = now() - interval '1 second'").format(ident)
    )
    other = store.claim("stale", 1, lease=42)
    assert len(other) == 1
    message.ack()
    conn.default_channel.connection.flush_acks()
    assert _rows(db, schema) == 1  # the newer delivery's row survives the stale ack
