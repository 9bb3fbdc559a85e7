"""Batched acks (the default): one DELETE per batch, and a transport reads its own acks."""

from __future__ import annotations

import threading

import psycopg
from helpers import row_count
from kombu import Consumer, Queue
from psycopg import sql
from waiting import wait_for

from kombu_pgqueue.bulk import publish_many


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
    assert row_count(db, schema) == 0


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
        wait_for(lambda: row_count(db, schema) == 0, 5, "the background flusher to send the acks")


def test_a_stale_batched_ack_does_not_delete_a_newer_delivery(make_connection, store, db, schema):
    conn = make_connection(batch_acks=True)
    publish_many(conn, ["x"], "stale")
    message = conn.default_channel.basic_get("stale")
    assert message is not None
    # the lease lapses and another consumer claims the message
    ident = sql.Identifier(schema)
    db.execute(
        sql.SQL("UPDATE {}.message_store SET next_iteration = now() - interval '1 second'").format(
            ident
        )
    )
    other = store.claim("stale", 1, lease=42)
    assert len(other) == 1
    message.ack()
    conn.default_channel.connection.flush_acks()
    assert row_count(db, schema) == 1  # the newer delivery's row survives the stale ack


def test_a_count_after_an_ack_waits_for_the_batch_on_its_way(make_connection, db, dsn, schema):
    """The batcher's thread has taken the ack and its DELETE waits (here for a lock on
    the row): a message count read meanwhile by the same transport waits for that batch
    too, rather than finding nothing pending and counting the acked message."""
    conn = make_connection(batch_acks=True)
    publish_many(conn, ["x"], "racing")
    channel = conn.default_channel
    message = channel.basic_get("racing")
    assert message is not None
    counted: list[int] = []
    done = threading.Event()

    def count() -> None:
        counted.append(channel.queue_declare("racing", passive=True).message_count)
        done.set()

    row = sql.SQL("SELECT 1 FROM {}.message_store FOR UPDATE").format(sql.Identifier(schema))
    blocked = "SELECT count(*) > 0 FROM pg_stat_activity WHERE %s = ANY(pg_blocking_pids(pid))"
    with psycopg.connect(dsn) as locker:
        locker.execute(row)
        message.ack()
        pid = locker.info.backend_pid
        wait_for(lambda: db.execute(blocked, (pid,)).fetchone()[0], 30, "the batch to wait")
        counter = threading.Thread(target=count)
        counter.start()
        wait_for(done, 0.5, "the count to return while the batch waits", never=True)
    wait_for(done, 30, "the count to return once the batch is in")
    counter.join()
    assert counted == [0]
