"""Backups and restores of the broker's schema with PostgreSQL's own pg_dump and
pg_restore (tests/backups.py finds those of the server's version): a dump of storage that
has rotated through generations and eras holds every waiting message once, and the
restored schema is a broker that runs: its messages delivered once, new ones too, and
the rotation going on. docs/operations.md, "Backups and restores", says the same.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import backups
import psycopg
import pytest
from helpers import drain, new_database, row_count
from kombu import Connection, Producer, Queue
from psycopg import sql

from kombu_pgqueue import embedded
from kombu_pgqueue._rotation import rotate

KEPT = "backlog"  # a queue no one consumes until the restore
BUSY = "busy"  # a queue drained as generations turn


@pytest.fixture
def holder(dsn: str) -> Iterator[psycopg.Connection]:
    with psycopg.connect(dsn) as conn:
        yield conn


def _publish(conn: Connection, queue: str, payloads: list[dict[str, Any]]) -> None:
    producer = Producer(conn)
    for payload in payloads:
        producer.publish(
            payload,
            routing_key=queue,
            dedup_key=payload.get("key"),
            priority=payload.get("priority", 0),
        )


@pytest.fixture
def rotated(
    make_connection: Callable[..., Connection],
    holder: psycopg.Connection,
    db: psycopg.Connection,
    schema: str,
) -> list[dict[str, Any]]:
    """A schema whose storage turned through generations and two eras (a reader held the
    first while generations emptied, as a dump would, which closed it), with spare
    tables, and messages waiting in KEPT across several generations: their payloads."""
    conn = make_connection(generation_max_age=0)
    for name in (KEPT, BUSY):
        Queue(name, channel=conn.default_channel, max_priority=9).declare()
    waiting: list[dict[str, Any]] = []

    def round_(n: int, keep: int) -> None:
        batch = [{"round": n, "i": i, "key": f"k-{n}-{i}", "priority": i % 3} for i in range(keep)]
        waiting.extend(batch)
        _publish(conn, KEPT, batch)
        _publish(conn, BUSY, [{"busy": n, "i": i} for i in range(20)])
        rotate(conn.default_channel.store)
        assert len(drain(conn, BUSY)) == 20

    for n in range(3):
        round_(n, 10)
    with holder.transaction():
        holder.execute(
            sql.SQL("LOCK TABLE {} IN ACCESS SHARE MODE").format(
                sql.Identifier(schema, "message_store")
            )
        )
        for n in range(3, 9):
            round_(n, 5)
    for n in range(9, 14):
        round_(n, 5)
    kinds = Counter(
        kind
        for (kind,) in db.execute(
            sql.SQL("SELECT kind FROM {}").format(sql.Identifier(schema, "spare"))
        ).fetchall()
    )
    # the closed era held no generation once the reader ended: kept as a spare, as the
    # generations emptied under it are
    assert row_count(db, schema, "era") + kinds["era"] >= 2
    assert kinds["generation"] >= 1
    assert backups.storage_disagreements(db, schema) == []
    return waiting


def _restored_broker(
    restored_dsn: str, schema: str, waiting: list[dict[str, Any]], *, with_data: bool
) -> None:
    """The restored schema as a broker: what waited delivered once, new publishes
    delivered, the rotation going on with its bookkeeping agreeing with the tables."""
    conn = Connection(
        embedded.broker_url(restored_dsn),
        transport_options={
            "schema": schema,
            "polling_interval": 0.5,
            "batch_acks": False,
            "generation_max_age": 0,
        },
    )
    conn.connect()
    try:
        got = drain(conn, KEPT)
        expected = waiting if with_data else []
        assert Counter(map(repr, got)) == Counter(map(repr, expected))
        # new publishes, one of them with a key an old message held
        fresh = [{"fresh": i, "key": f"k-0-{i}"} for i in range(3)] + [{"fresh": 3}]
        _publish(conn, KEPT, fresh)
        assert Counter(map(repr, drain(conn, KEPT))) == Counter(map(repr, fresh))
        with psycopg.connect(restored_dsn, autocommit=True) as db:
            before = set(backups.tables(db, schema))
            for n in range(6):
                _publish(conn, BUSY, [{"after": n}])
                rotate(conn.default_channel.store)
                assert drain(conn, BUSY) == [{"after": n}]
            assert backups.storage_disagreements(db, schema) == []
            assert set(backups.tables(db, schema)) >= before  # nothing dropped
            states = Counter(
                state
                for (state,) in db.execute(
                    sql.SQL("SELECT state FROM {}").format(sql.Identifier(schema, "generation"))
                ).fetchall()
            )
            assert states["current"] == 1 and states["next"] == 1
    finally:
        conn.release()


def test_a_dump_restores_every_waiting_message_into_a_broker_that_runs(
    rotated: list[dict[str, Any]], dsn: str, schema: str, tmp_path: Path
) -> None:
    path = backups.dump(dsn, schema, tmp_path / "broker.dump")
    with new_database(dsn, "restored") as restored:
        backups.restore(restored, path)
        with psycopg.connect(restored) as conn:
            assert backups.storage_disagreements(conn, schema) == []
        _restored_broker(restored, schema, rotated, with_data=True)


def test_a_schema_only_restore_then_its_data_gives_the_same_broker(
    rotated: list[dict[str, Any]], dsn: str, schema: str, tmp_path: Path
) -> None:
    path = backups.dump(dsn, schema, tmp_path / "broker.dump")
    with new_database(dsn, "restored") as restored:
        backups.restore(restored, path, "--schema-only")
        backups.restore(restored, path, "--data-only")
        _restored_broker(restored, schema, rotated, with_data=True)


def test_a_dump_without_the_messages_restores_an_empty_broker_that_runs(
    rotated: list[dict[str, Any]], dsn: str, schema: str, tmp_path: Path
) -> None:
    """The documented way to leave in-flight messages out of a backup."""
    path = backups.dump(
        dsn, schema, tmp_path / "broker.dump", f"--exclude-table-data={schema}.message_*"
    )
    with new_database(dsn, "restored") as restored:
        backups.restore(restored, path)
        _restored_broker(restored, schema, rotated, with_data=False)


def test_a_dump_whose_snapshot_is_older_than_its_sequences_restores_a_broker_that_runs(
    rotated: list[dict[str, Any]],
    make_connection: Callable[..., Connection],
    holder: psycopg.Connection,
    dsn: str,
    schema: str,
    tmp_path: Path,
) -> None:
    """pg_dump reads a sequence's value when it dumps it, not as its snapshot saw it: a
    dump of a long run holds the generations as they were when it began, and the
    generation sequence as it was later, at generations it does not hold. Here the
    snapshot is exported first (``pg_dump --snapshot``) and the storage turns after."""
    holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
    row = holder.execute("SELECT pg_export_snapshot()").fetchone()
    assert row is not None
    conn = make_connection(generation_max_age=0)
    for n in range(3):  # generations the dump will not hold, the sequence at the last
        _publish(conn, BUSY, [{"later": n}])
        rotate(conn.default_channel.store)
        assert drain(conn, BUSY) == [{"later": n}]
    path = backups.dump(dsn, schema, tmp_path / "broker.dump", f"--snapshot={row[0]}")
    holder.rollback()
    with new_database(dsn, "restored") as restored:
        backups.restore(restored, path)
        _restored_broker(restored, schema, rotated, with_data=True)
