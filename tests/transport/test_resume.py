"""Claims that resume after the consumer's last message (see kombu_pgqueue._resume).

With an old snapshot held elsewhere, acked rows at the head of a queue cannot be
vacuumed and a claim from the head steps over all of them; a consumer whose claim was
slow resumes after its last message instead, and goes back to the head every
``resume_seconds`` (or 20 times the slow claim). Here every claim counts as slow and
the period never ends unless a test moves the consumer's clock (:func:`transport_options`).
"""

from __future__ import annotations

import re
import time

import psycopg
import pytest
from helpers import ALWAYS_RESUMED, fill
from kombu import Connection, Consumer, Queue
from kombu.message import Message
from psycopg import sql

from kombu_pgqueue import _pacing
from kombu_pgqueue._pool import SESSION_SETTINGS
from kombu_pgqueue._store import Store, new_lease


@pytest.fixture
def transport_options(transport_options: dict[str, object]) -> dict[str, object]:
    return {**transport_options, **ALWAYS_RESUMED}


def test_store_claim_after_takes_only_later_ids_of_that_priority(
    connection: Connection, store: Store
) -> None:
    fill(connection, "r", range(6))
    fill(connection, "r", ["high"], priority=9)
    first = store.claim("r", 2, new_lease())
    assert [row.priority for row in first] == [9, 0]
    after = (0, first[-1].id)
    rest = store.claim("r", 10, new_lease(), after=after)
    assert [row.id for row in rest] == sorted(row.id for row in rest)
    assert all(row.priority == 0 and row.id > first[-1].id for row in rest)
    assert len(rest) == 5


def test_a_resuming_consumer_still_delivers_everything_once_with_a_snapshot_held(
    connection: Connection, dsn: str
) -> None:
    consumer = connection.transport.consumer
    fill(connection, "snap", range(40))
    with psycopg.connect(dsn) as holder:
        holder.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        holder.execute("SELECT 1")  # the snapshot that keeps VACUUM from removing acked rows
        channel = connection.channel()
        got = []
        requeued_at = caught_up_at = None
        for _ in range(60):
            if len(got) == 40:
                break
            message = channel.basic_get("snap")
            if message is None:
                # caught up: the requeued message is behind the resume position, and
                # is not looked for at the head before the resume period ends; end
                # the period now instead of waiting for it
                assert caught_up_at is None, "still nothing after the period ended"
                caught_up_at = time.monotonic()
                position = consumer.resume_position("snap")
                assert position is not None
                consumer.clock.advance(position[2] - consumer.clock() + 1)
                continue
            assert consumer.resume_position("snap") is not None or not got or requeued_at
            if message.payload == 5 and requeued_at is None:
                message.requeue()  # an older id becomes ready behind the resume position
                requeued_at = time.monotonic()
                continue
            got.append(message.payload)
            message.ack()
        holder.rollback()
    assert sorted(got) == list(range(40))
    assert len(got) == 40
    # the requeued message came back last, once the resume period was over: before
    # that, the caught-up consumer found nothing after its position
    assert got[-1] == 5
    assert requeued_at is not None and caught_up_at is not None


@pytest.mark.parametrize(
    ("statement", "condition", "index_cond"),
    [
        (
            "claim_after",
            "%priority = $%::smallint AND id > $%::bigint%",
            r"Index Cond: .*\(priority = \$\d+\) AND \(id > \(?\$\d+",
        ),
        ("claim_above", "%AND priority > $%::smallint%", r"Index Cond: .*\(priority > \$\d+\)"),
    ],
)
def test_the_resumed_claim_starts_the_index_scan_at_the_position_in_its_generic_plan(
    connection: Connection,
    store: Store,
    db: psycopg.Connection,
    statement: str,
    condition: str,
    index_cond: str,
) -> None:
    # prepared once, claim_after (and claim_above) run from their generic plans: the
    # position must be part of the index condition there, with no values to plan with
    fill(connection, "plan", range(3))
    from kombu_pgqueue import _sql

    params = {
        "queue": "plan",
        "limit": 10,
        "lease": 1,
        "lease_seconds": 60.0,
        "max_attempts": 5,
        "now": None,
        "after_priority": 0,
        "after_id": 1,
        "synchronous_commit": None,
        "floor": store.generations.floor,
    }
    query = _sql.queries(store.schema)[statement]
    db.autocommit = True
    db.execute("SET plan_cache_mode = force_generic_plan")
    db.execute(SESSION_SETTINGS)  # as on the broker's own connections
    db.execute(query, params, prepare=True)
    [(name,)] = db.execute(
        "SELECT name FROM pg_prepared_statements WHERE statement LIKE %s",
        (condition,),
    ).fetchall()
    # psycopg numbers the placeholders in order of first appearance
    order = list(dict.fromkeys(re.findall(r"%\((\w+)\)s", query.as_string(None))))
    explain = sql.SQL("EXPLAIN (FORMAT TEXT) EXECUTE {}({})").format(
        sql.Identifier(name), sql.SQL(", ").join(sql.Literal(params[k]) for k in order)
    )
    plan = "\n".join(row[0] for row in db.execute(explain))
    assert "Seq Scan on message" not in plan
    assert re.search(index_cond, plan), plan


def test_a_higher_priority_reaches_a_resumed_consumer_without_waiting_for_the_period(
    connection: Connection,
) -> None:
    consumer = connection.transport.consumer
    consumer.clock.freeze()  # moved by the test only
    fill(connection, "above", range(30))
    got: list[object] = []

    def take(body: object, message: Message) -> None:
        got.append(body)
        message.ack()

    kombu_consumer = Consumer(connection, [Queue("above")], callbacks=[take], prefetch_count=4)
    kombu_consumer.consume()
    connection.drain_events(timeout=5)
    position = consumer.resume_position("above")
    assert position is not None and position[0] == 0  # resumed after the first claim
    fill(connection, "above", ["high"], priority=9)
    seen = len(got)
    connection.drain_events(timeout=5)
    assert "high" not in got[seen:]  # not due yet: the head was read just now
    consumer.clock.advance(_pacing.ABOVE_SECONDS)
    seen = len(got)
    connection.drain_events(timeout=5)
    # still resumed (the same period), and the next claim read the priorities above it
    assert consumer.resume_position("above") is not None
    assert consumer.resume_position("above")[2] == position[2]  # type: ignore[index]
    assert got[seen:] == ["high"]
    while len(got) < 31:
        connection.drain_events(timeout=5)
    assert sorted(map(str, got)) == sorted(map(str, [*range(30), "high"]))
    kombu_consumer.cancel()
