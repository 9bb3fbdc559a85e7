"""Dedup keys held in a table of their own (migration 0011), the first step towards
storage that rotates: an upgrade keeps the keys already held, and the previous
version's publishes and this version's agree on which keys are taken."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import psycopg
from kombu import Connection, Queue
from psycopg import sql

from kombu_pgqueue import migrate
from kombu_pgqueue._rotation import rotate

QUEUE = "keys"


def _previous_publish(db: psycopg.Connection, schema: str, key: str, body: str) -> bool:
    """Insert as the previous version's publish statement did (ON CONFLICT on the
    table's unique index); True if it stored the message."""
    row = db.execute(
        sql.SQL(
            "INSERT INTO {}.message (queue, dedup_key, body, headers, properties)"
            " VALUES (%s, %s, %s, '{{}}', '{{}}')"
            " ON CONFLICT (queue, dedup_key) WHERE dedup_key IS NOT NULL DO NOTHING"
            " RETURNING id"
        ).format(sql.Identifier(schema)),
        (QUEUE, key, body.encode()),
    ).fetchone()
    return row is not None


def _publish(connection: Connection, key: str, body: str) -> None:
    producer = connection.Producer()
    producer.publish({"b": body}, routing_key=QUEUE, headers={"dedup_key": key})


def _bodies(connection: Connection) -> list[Any]:
    queue = Queue(QUEUE, channel=connection.default_channel)
    found = []
    while (message := queue.get(no_ack=True)) is not None:
        found.append(message.payload)
    return found


def test_a_key_held_before_the_upgrade_still_skips_its_duplicate(
    dsn: str, schema: str, db: psycopg.Connection, make_connection: Callable[..., Connection]
) -> None:
    migrate(dsn, schema, to=10)
    assert _previous_publish(db, schema, "k", "before the upgrade")
    migrate(dsn, schema)
    with make_connection() as connection:
        Queue(QUEUE, channel=connection.default_channel).declare()
        _publish(connection, "k", "after the upgrade")
        stored = sql.SQL("SELECT body FROM {}.message WHERE dedup_key = 'k'").format(
            sql.Identifier(schema)
        )
        assert db.execute(stored).fetchall() == [(b"before the upgrade",)]
        rotate(connection.default_channel.store)  # what a consumer does: into message_store
        assert len(_bodies(connection)) == 1  # the old one, taken: the key is free again
        _publish(connection, "k", "once it is gone")
        assert _bodies(connection) == [{"b": "once it is gone"}]


def test_the_previous_versions_publish_and_this_ones_agree_on_taken_keys(
    schema: str, db: psycopg.Connection, connection: Connection
) -> None:
    Queue(QUEUE, channel=connection.default_channel).declare()
    _publish(connection, "new", "this version")
    assert not _previous_publish(db, schema, "new", "previous version")
    assert _previous_publish(db, schema, "old", "previous version")
    _publish(connection, "old", "this version")
    rotate(connection.default_channel.store)  # the previous version's message comes over
    bodies = _bodies(connection)
    assert {"b": "this version"} in bodies
    assert len(bodies) == 2  # one per key


def test_a_copy_a_role_runs_itself_skips_a_taken_key_without_an_error(
    schema: str, db: psycopg.Connection, connection: Connection
) -> None:
    """Any insert claims its key (a trigger), not only the broker's statements: an
    application's own COPY into the queue skips what is taken instead of failing."""
    # (into message_store, this version's table; _previous_publish writes the old one)
    Queue(QUEUE, channel=connection.default_channel).declare()
    _publish(connection, "k1", "first")
    columns = sql.SQL("(queue, dedup_key, body, headers, properties)")
    with db.cursor().copy(
        sql.SQL("COPY {}.message_store {} FROM STDIN").format(sql.Identifier(schema), columns)
    ) as copy:
        for key in ("k1", "k2", "k2"):
            copy.write_row((QUEUE, key, b'{"b": "copied"}', "{}", "{}"))
    keys = db.execute(
        sql.SQL("SELECT dedup_key FROM {}.message_store ORDER BY id").format(sql.Identifier(schema))
    ).fetchall()
    assert [k for (k,) in keys] == ["k1", "k2"]
