"""Monitor: queue depths by state and the oldest ready age, against a known state; counts
become flagged estimates above the cap."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from kombu_pgqueue._monitor import Monitor, QueueDepth
from kombu_pgqueue._options import parse_options
from kombu_pgqueue._store import Outgoing, Store, new_lease


def message(queue: str, priority: int = 0, **extra: object) -> Outgoing:
    return Outgoing(
        queue=queue, body=b"x", headers="{}", properties="{}", priority=priority, **extra
    )


def oldest_ready_age(db: psycopg.Connection, schema: str, queue: str, now: object) -> float:
    row = db.execute(
        sql.SQL(
            "SELECT extract(EPOCH FROM %s::timestamptz - min(created_at))::float8 FROM {} "
            "WHERE queue = %s AND NOT delayed AND lease IS NULL"
        ).format(sql.Identifier(schema, "message_store")),
        (now, queue),
    ).fetchone()
    assert row is not None
    return float(row[0])


def test_queue_depths_match_a_known_state(store, monitor, db, schema, later):
    for priority in (0, 9, 0, 5):  # the oldest ready one is at priority 0, behind others
        store.publish(message("mixed", priority))
    store.publish_many([message("plain") for _ in range(5)])
    store.publish(message("plain", eta=later(3600)))
    store.publish(message("only_delayed", eta=later(3600)))
    assert [d.priority for d in store.claim("mixed", 2, new_lease())] == [9, 5]
    store.claim("plain", 3, lease := new_lease())
    held = store.claim("plain", 1, lease)
    store.bury(held[0].id, lease, "rejected")
    store.declare_queue("declared")
    now = later(5)  # leases (60 s) still held

    depths = {d.queue: d for d in monitor.queue_depths(now=now)}

    counts = {q: (d.ready, d.leased, d.delayed, d.dead) for q, d in depths.items()}
    assert counts == {
        "declared": (0, 0, 0, 0),
        "mixed": (2, 2, 0, 0),
        "only_delayed": (0, 0, 1, 0),
        "plain": (1, 3, 1, 1),
    }
    assert all(d.ready_exact and d.delayed_exact and d.dead_exact for d in depths.values())
    for queue in ("mixed", "plain"):
        assert depths[queue].oldest_ready_age == pytest.approx(
            oldest_ready_age(db, schema, queue, now), abs=1e-6
        )
        assert depths[queue].oldest_ready_age >= 5
    assert depths["declared"].oldest_ready_age is None
    assert depths["only_delayed"].oldest_ready_age is None


def test_queue_depths_agree_with_the_full_scan_of_queue_stats(store, monitor, later):
    store.publish_many([message(f"q{i % 3}", i % 4) for i in range(30)])
    store.publish(message("q1", eta=later(60)))
    lease = new_lease()
    taken = store.claim("q0", 4, lease)
    store.bury(taken[0].id, lease, "rejected")

    by_index = [(d.queue, d.ready, d.delayed, d.leased, d.dead) for d in monitor.queue_depths()]

    assert by_index == [
        (s.queue, s.ready, s.delayed, s.leased, s.dead) for s in store.queue_stats()
    ]


def test_a_lapsed_lease_counts_as_ready_again(store, monitor, later):
    store.publish_many([message("work") for _ in range(3)])
    store.claim("work", 2, new_lease())

    [before] = monitor.queue_depths(now=later(1))
    [after] = monitor.queue_depths(now=later(120))  # past the 60 s lease

    assert (before.ready, before.leased) == (1, 2)
    assert (after.ready, after.leased) == (3, 0)
    assert after.oldest_ready_age > before.oldest_ready_age


def analyzed(db: psycopg.Connection, schema: str, statements: list[str]) -> None:
    """Run ``statements`` on one session, flush its statistics, then ANALYZE: the live-row
    counts and the per-queue shares the estimates read are then exact."""
    for statement in statements:
        db.execute(sql.SQL(statement).format(s=sql.Identifier(schema)))
    db.execute("SELECT pg_stat_force_next_flush()")
    db.execute(
        sql.SQL("ANALYZE {s}.message_store, {s}.dead_letter").format(s=sql.Identifier(schema))
    )


INSERT = (
    "INSERT INTO {{s}}.message_store (queue, delayed, next_iteration, body, headers, properties) "
    "SELECT '{queue}', {delayed}, now() + interval '{ahead}', 'x', '{{{{}}}}', '{{{{}}}}' "
    "FROM generate_series(1, {n})"
)
DEAD = (
    "INSERT INTO {{s}}.dead_letter (id, queue, priority, attempts, reason, created_at, "
    "body, headers, properties) "
    "SELECT -i - {offset}, '{queue}', 0, 5, 'max_attempts', now(), 'x', '{{{{}}}}', '{{{{}}}}' "
    "FROM generate_series(1, {n}) AS i"
)


def test_counts_above_the_cap_are_estimates_from_the_statistics(store, db, schema):
    monitor = Monitor(store, cap=5)
    store.declare_queue("big")  # migrates the schema
    analyzed(
        db,
        schema,
        [
            INSERT.format(queue="big", delayed="false", ahead="0 s", n=20),
            INSERT.format(queue="small", delayed="false", ahead="0 s", n=3),
            INSERT.format(queue="later", delayed="true", ahead="1 hour", n=8),
            # due after all of "later": beyond the 5 soonest, found by the statistics
            INSERT.format(queue="far", delayed="true", ahead="2 hours", n=10),
            DEAD.format(queue="big", n=7, offset=0),
            DEAD.format(queue="small", n=2, offset=100),
        ],
    )

    depths = {d.queue: d for d in monitor.queue_depths()}

    # 20 ready in "big" and 7 of its dead letters are more than 5: estimated, and the
    # statistics of tables this small are exact; 18 delayed in all are more than 5 too
    assert depths["big"] == QueueDepth(
        queue="big",
        ready=20,
        leased=0,
        delayed=0,
        dead=7,
        ready_exact=False,
        delayed_exact=False,
        dead_exact=False,
        oldest_ready_age=depths["big"].oldest_ready_age,
    )
    assert (depths["later"].delayed, depths["later"].delayed_exact) == (8, False)
    assert (depths["far"].delayed, depths["far"].delayed_exact) == (10, False)
    small = depths["small"]
    assert (small.ready, small.ready_exact, small.dead, small.dead_exact) == (3, True, 2, True)
    assert depths["big"].oldest_ready_age is not None


def test_above_the_cap_without_statistics_the_count_is_the_cap_plus_one(store, db, schema):
    monitor = Monitor(store, cap=5)
    store.publish_many([message("fresh") for _ in range(12)])  # never analyzed

    [fresh] = monitor.queue_depths()

    assert (fresh.ready, fresh.ready_exact, fresh.oldest_ready_age is not None) == (6, False, True)


def test_cap_zero_reports_every_nonempty_count_as_an_estimate(store):
    store.publish(message("one"))

    [one] = Monitor(store, cap=0).queue_depths()

    assert (one.ready_exact, one.dead_exact, one.dead) == (False, True, 0)
    with pytest.raises(ValueError, match="cap must be at least 0"):
        Monitor(store, cap=-1)


def test_table_sizes(store, monitor, db, schema, later):
    store.publish_many([message("sized") for _ in range(10)])
    db.execute(sql.SQL("VACUUM ANALYZE {}").format(sql.Identifier(schema, "message_store")))

    tables = {t.table: t for t in monitor.table_sizes(now=later(2))}

    assert set(tables) == {"dead_letter", "message"}
    assert tables["message"].live_rows == 10
    assert tables["message"].total_bytes > 0
    assert tables["message"].last_vacuum_age is not None
    assert tables["message"].last_vacuum_age >= 2
    assert tables["dead_letter"].live_rows == 0


@pytest.fixture
def reader(dsn: str, db: psycopg.Connection, schema: str, store: Store) -> Iterator[str]:
    """The DSN of a role that may only read the (migrated) schema."""
    role = f"pgq_reader_{uuid.uuid4().hex[:10]}"
    db.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
    try:
        grants = [
            "GRANT USAGE ON SCHEMA {schema} TO {role}",
            "GRANT SELECT ON ALL TABLES IN SCHEMA {schema} TO {role}",
        ]
        for grant in grants:
            db.execute(
                sql.SQL(grant).format(schema=sql.Identifier(schema), role=sql.Identifier(role))
            )
        yield make_conninfo(**{**(conninfo_to_dict(dsn) if dsn else {}), "user": role})
    finally:
        db.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
        db.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def test_a_role_that_may_only_read_can_monitor(reader, store, db, schema):
    analyzed(db, schema, [INSERT.format(queue="read", delayed="false", ahead="0 s", n=3)])
    options = parse_options({"schema": schema, "auto_migrate": False})
    monitor = Monitor(Store(reader, options), cap=1)

    [read] = monitor.queue_depths()

    # 3, not the cap + 1: the estimate read the statistics, which need SELECT only
    assert (read.queue, read.ready, read.ready_exact) == ("read", 3, False)
    assert {t.table for t in monitor.table_sizes()} == {"message", "dead_letter"}
