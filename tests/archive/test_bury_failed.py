"""The failed-task archive's statements through the admin API, against a real schema.

``bury_failed`` (a task that failed for good, kept as a dead letter with reason
``failed``), and the listing and trimming by reason and age. Time moves with ``now=``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any

import plans
import psycopg
import pytest
from psycopg import sql

from kombu_pgqueue._sql import queries
from kombu_pgqueue._store import Store, new_lease
from kombu_pgqueue.admin import Broker, Failure, Outgoing

Later = Callable[[float], datetime]

STORED = Outgoing(
    queue="q",
    body=b"[[1], {}, {}]",
    headers='{"id": "t-1", "task": "app.charge"}',
    properties='{"priority": 3}',
    content_type="application/json",
    content_encoding="utf-8",
    priority=3,
    dedup_key="celery:t-1:call",
)

#: what a worker rebuilds of it from the task's request (no publish call's dedup key)
REBUILT = replace(STORED, body=b"[[1], {}, {}] ", dedup_key=None)


@pytest.fixture
def broker(dsn: str, schema: str, store: Store) -> Broker:
    return Broker(dsn, schema=schema)


def held(store: Store, message: Outgoing = STORED) -> tuple[int, int]:
    """Publish ``message`` and claim it: (id, lease) of the delivery."""
    store.publish(message)
    lease = new_lease()
    (delivered,) = store.claim(message.queue, 1, lease)
    return delivered.id, lease


def failure(id: int, lease: int, **fields: object) -> Failure:
    values: dict[str, object] = {
        "id": id,
        "lease": lease,
        "attempts": 1,
        "message": REBUILT,
        "error": "app.Declined: card declined",
        "traceback": "Traceback (most recent call last):\n...\napp.Declined: card declined\n",
    }
    return Failure(**{**values, **fields})  # type: ignore[arg-type]


def message_ids(db: psycopg.Connection, schema: str) -> list[int]:
    query = sql.SQL("SELECT id FROM {} ORDER BY id").format(sql.Identifier(schema, "message_store"))
    return [row[0] for row in db.execute(query)]


def test_bury_failed_copies_a_held_message_and_the_ack_deletes_it(broker, store, db, schema):
    id, lease = held(store)

    assert broker.bury_failed(failure(id, lease)) == id

    (letter,) = broker.dead_letters(reason="failed")
    assert (letter.id, letter.queue, letter.reason, letter.attempts) == (id, "q", "failed", 1)
    assert letter.error == "app.Declined: card declined"
    assert letter.traceback is not None and letter.traceback.endswith("card declined\n")
    # as it was stored, not as the worker rebuilt it
    assert (bytes(letter.body), letter.priority) == (STORED.body, 3)
    assert broker.dead_letter(id) == letter
    # the worker's ack follows, and finds its row
    assert message_ids(db, schema) == [id]
    assert store.ack(id, lease)
    assert message_ids(db, schema) == []


def test_bury_failed_moves_a_held_message_when_a_reject_follows(broker, store, db, schema):
    id, lease = held(store)

    assert broker.bury_failed(failure(id, lease, move=True)) == id

    assert message_ids(db, schema) == []
    assert not store.bury(id, lease, "rejected")  # the worker's reject finds nothing
    assert [(d.id, d.reason, bytes(d.body)) for d in broker.dead_letters()] == [
        (id, "failed", STORED.body)
    ]


def test_bury_failed_writes_the_rebuilt_message_once_an_ack_deleted_it(broker, store):
    id, lease = held(store)
    assert store.ack(id, lease)  # an early ack, before the task ran

    assert broker.bury_failed(failure(id, lease, attempts=2)) == id

    (letter,) = broker.dead_letters()
    assert (letter.id, letter.reason, letter.attempts) == (id, "failed", 2)
    assert (bytes(letter.body), letter.headers) == (REBUILT.body, REBUILT.headers)
    assert (letter.content_type, letter.content_encoding) == ("application/json", "utf-8")


def test_bury_failed_leaves_a_message_that_another_delivery_holds(broker, store, later):
    id, lapsed = held(store)
    (again,) = store.claim("q", 1, new_lease(), now=later(3600))  # the lease ran out

    assert again.id == id
    assert broker.bury_failed(failure(id, lapsed)) is None
    assert broker.bury_failed(failure(id, lapsed, move=True)) is None

    assert broker.dead_letters() == []
    assert store.size("q", now=later(7200)) == 1  # still there, for its delivery to settle


def test_bury_failed_takes_over_the_letter_of_a_reject_that_came_first(broker, store):
    id, lease = held(store)
    assert store.bury(id, lease, "rejected")

    assert broker.bury_failed(failure(id, lease, attempts=3)) == id

    (letter,) = broker.dead_letters()
    assert (letter.id, letter.reason, letter.error, letter.attempts) == (
        id,
        "failed",
        "app.Declined: card declined",
        3,
    )
    assert bytes(letter.body) == STORED.body  # the stored message, from the reject


def test_a_requeued_failed_letter_keeps_its_dedup_key_and_headers(broker, store):
    id, lease = held(store)
    broker.bury_failed(failure(id, lease))
    store.ack(id, lease)

    assert broker.requeue_dead([id]) == ["q"]

    (again,) = store.claim("q", 1, new_lease())
    assert again.id != id
    assert (again.headers, bytes(again.body)) == (STORED.headers, STORED.body)
    assert broker.dead_letters() == []


def test_dead_letters_filter_by_reason_and_queue(broker, store):
    first, lease = held(store)
    broker.bury_failed(failure(first, lease))
    store.ack(first, lease)
    second, lease = held(store, replace(STORED, queue="other", dedup_key=None))
    store.bury(second, lease, "rejected")

    assert [d.id for d in broker.dead_letters()] == [first, second]
    assert [d.id for d in broker.dead_letters(reason="failed")] == [first]
    assert [d.id for d in broker.dead_letters(reason="rejected")] == [second]
    assert broker.dead_letters("other", reason="failed") == []
    assert [d.reason for d in broker.dead_letters("q", limit=None)] == ["failed"]
    # listings carry the traceback of failed tasks only
    assert [d.traceback is not None for d in broker.dead_letters()] == [True, False]


def test_purge_dead_older_than_counts_from_when_they_died(broker, store, later):
    first, lease = held(store)
    broker.bury_failed(failure(first, lease))
    store.ack(first, lease)
    second, lease = held(store, replace(STORED, dedup_key=None))
    store.bury(second, lease, "rejected")

    week = timedelta(days=7)
    assert broker.purge_dead(older_than=week) == 0
    assert broker.purge_dead(older_than=week, now=later(6 * 86400)) == 0
    assert broker.purge_dead(reason="failed", older_than=week, now=later(8 * 86400)) == 1
    assert [d.id for d in broker.dead_letters()] == [second]
    assert broker.purge_dead("other", older_than=week, now=later(8 * 86400)) == 0
    assert broker.purge_dead(older_than=week, now=later(8 * 86400)) == 1
    assert broker.dead_letters() == []


def test_archive_statements_reach_rows_by_index(db, schema, broker):
    """On a month of 20,000 dead letters and as many messages, analyzed: a failure reads
    its message by key, a listing by reason and a trim of the oldest read the indexes of
    migration 0006 (EXPLAIN as the store sends them, sequential scans allowed)."""
    broker.migrate()
    table = sql.Identifier(schema, "dead_letter")
    db.execute(
        sql.SQL(
            """
            INSERT INTO {} (id, queue, priority, attempts, reason, created_at, died_at,
                            body, headers, properties)
            SELECT i, 'q', 0, 1, (ARRAY['failed', 'rejected', 'max_attempts'])[i % 3 + 1],
                   now(), now() - make_interval(secs => i * 130), '', '{{}}', '{{}}'
            FROM generate_series(1, 20000) AS i
            """
        ).format(table)
    )
    broker.publish_many([replace(STORED, dedup_key=None)] * 20000)
    db.execute(sql.SQL("ANALYZE {}").format(table))
    db.execute(sql.SQL("ANALYZE {}").format(sql.Identifier(schema, "message_store")))

    def plan(name: str, params: dict[str, object]) -> list[dict[str, Any]]:
        query = sql.SQL("EXPLAIN (FORMAT JSON) ") + queries(schema)[name]
        row = db.execute(query, params).fetchone()
        assert row is not None
        return list(plans.nodes(row[0][0]["Plan"]))

    bury = failure(123, 42, move=True).params()
    listing = {"queue": None, "reason": "failed", "limit": 50}
    trim = {"queue": None, "reason": None, "older_than": 29 * 86400.0, "now": None}
    by_age = {"dead_letter_reason_idx", "dead_letter_died_idx"}
    for name, params, indexes in [
        ("bury_failed", bury, {"message_store_pkey"}),
        # the oldest first: by reason, or in died_at order until 50 of the reason
        ("dead_letters_where", listing, by_age),
        ("purge_dead_where", trim, by_age),
    ]:
        nodes = plan(name, params)
        assert plans.seq_scans(db, nodes) == [], name
        assert indexes & plans.indexes(db, nodes), name
