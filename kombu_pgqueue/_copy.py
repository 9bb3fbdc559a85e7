"""The COPY loader: many staged rows into the queue in one transaction.

Bulk sends and Spark partitions write thousands of task messages at a time; a
``COPY`` into the queue table (or into a staging table, then an ``INSERT`` that
computes ETAs and TTLs) carries them. A dedup key another message holds is skipped
by the message table's trigger (migration 0011), whichever way the row goes in. Used by the store's
``publish_rows`` and by :func:`kombu_pgqueue.admin.load_staged` on a connection of
the caller's own.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import psycopg

from . import _errors, _sql
from .records import STAGING_COLUMNS


def load_staged(
    conn: psycopg.Connection,
    schema: str,
    channel: str,
    rows: Iterable[Sequence[Any]],
    *,
    ordered: bool = True,
    binary: bool = False,
    gate: bool = False,
) -> int:
    """Load ``rows`` (in :data:`STAGING_COLUMNS` order) into the queue in one transaction.

    Returns how many were inserted: a dedup key already waiting or running is
    skipped. Consumers get one NOTIFY per queue at commit (with ``gate``, only
    queues that a consumer waits for: for a transaction as short as the broker's own,
    see the top of sql/queries.sql). Messages without an ETA,
    for queues without a TTL, go by COPY straight into the queue table (the fast path:
    no staging table); the rest through a staging table.
    ``ordered=False`` lets ids follow any order within the staging path (cheaper for
    large loads); ``binary`` needs values of exactly the staging types (aware
    datetimes, ints within int2). For connections the caller opened itself, such as a
    Spark executor's; the broker's own publishes use :meth:`Store.publish_rows`.
    """
    statements = _sql.queries(schema)
    rows = rows if isinstance(rows, list) else list(rows)
    if not rows:
        return 0
    with conn.transaction():
        queues = sorted({row[0] for row in rows})
        found = conn.execute(statements["ttl_queues"], {"queues": queues}).fetchall()
        ttl = {name for (name,) in found}
        direct: list[Sequence[Any]] = []
        staged: list[Sequence[Any]] = []
        for row in rows:
            (direct if row[2] is None and row[0] not in ttl else staged).append(row)
        inserted = 0
        if direct:
            inserted = _copy_direct(conn, statements, direct, binary)
            ready = sorted({row[0] for row in direct})
            conn.execute(
                statements["notify_ready"], {"channel": channel, "queues": ready, "gate": gate}
            )
        if staged:
            inserted += _copy_staged(conn, schema, staged, channel, ordered, binary, gate)
    return inserted


def _copy(
    conn: psycopg.Connection,
    statement: Any,
    rows: Iterable[Sequence[Any]],
    types: list[str] | None,
) -> int:
    """Stream ``rows`` into one COPY; ``types`` for binary format, None for text.
    Returns the rows the server stored."""
    cursor = conn.cursor()
    with cursor.copy(statement) as copy:
        if types is not None:
            copy.set_types(types)
        write = copy.write_row
        for row in rows:
            write(row)
    return cursor.rowcount


def _copy_direct(
    conn: psycopg.Connection,
    statements: dict[str, Any],
    rows: list[Sequence[Any]],
    binary: bool,
) -> int:
    """COPY rows straight into the queue table; returns how many went in (a row whose
    dedup key is taken does not)."""
    types = [kind for name, kind in STAGING_COLUMNS if name != "eta"] if binary else None
    name = "copy_direct_binary" if binary else "copy_direct"
    return _copy(conn, statements[name], (tuple(row[:2]) + tuple(row[3:]) for row in rows), types)


def _copy_staged(
    conn: psycopg.Connection,
    schema: str,
    rows: list[Sequence[Any]],
    channel: str,
    ordered: bool,
    binary: bool,
    gate: bool,
) -> int:
    statements = _sql.queries(schema)
    with _errors.staging(conn, schema):
        conn.execute(statements["create_staging"])
    types = [kind for _, kind in STAGING_COLUMNS] if binary else None
    _copy(conn, statements["copy_staging_binary" if binary else "copy_staging"], rows, types)
    found = conn.execute(
        statements["publish_staged"], {"channel": channel, "ordered": ordered, "gate": gate}
    ).fetchall()
    return int(found[0][0]) if found else 0
