"""Query-plan regression for the monitoring statements: on a table with enough rows that
a scan would show, every message and dead-letter lookup walks an index.

60,000 messages (most in one queue, at three priorities, some leased), 2,000 delayed,
3,000 dead letters, then ANALYZE; ``EXPLAIN (FORMAT JSON)`` of each statement as the
monitor sends it, with the default cap and with a small one (the estimate path).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import plans
import psycopg
import pytest
from psycopg import sql
from waiting import wait_for

from kombu_pgqueue import migrate
from kombu_pgqueue._monitor import DEFAULT_CAP
from kombu_pgqueue._sql import queries

BROKER_TABLES = {"message", "dead_letter"}


def _broker_table(name: str | None) -> bool:
    """A table of messages: the previous version's, a generation of message_store (not
    the one attached ahead, 2, which is empty: its scan reads no page), or the dead
    letters."""
    if not name or name == "message_store_2":
        return False
    return name in BROKER_TABLES or name.startswith("message_store")


LOAD = [
    # "bulk" holds most rows, so a planner that likes scans would pick one for it
    "INSERT INTO {s}.message_store (queue, priority, body, headers, properties) "
    "SELECT CASE WHEN i <= 55000 THEN 'bulk' ELSE 'q' || (i %% 40) END, (i %% 3) * 4, "
    "'x', '{{}}', '{{}}' FROM generate_series(1, 60000) AS i",
    "INSERT INTO {s}.message_store (queue, delayed, next_iteration, body, headers, properties) "
    "SELECT 'q' || (i %% 7), true, now() + make_interval(secs => i), 'x', '{{}}', '{{}}' "
    "FROM generate_series(1, 2000) AS i",
    "UPDATE {s}.message_store"
    " SET lease = 1, attempts = 1, next_iteration = now() + interval '1 hour' "
    "WHERE id IN (SELECT id FROM {s}.message_store WHERE NOT delayed ORDER BY id LIMIT 50)",
    "INSERT INTO {s}.dead_letter (id, queue, priority, attempts, reason, created_at, body, "
    "headers, properties) SELECT -i, 'q' || (i %% 5), 0, 5, 'rejected', now(), 'x', '{{}}', "
    "'{{}}' FROM generate_series(1, 3000) AS i",
]
ANALYZE = ["VACUUM ANALYZE {s}.message_store", "VACUUM ANALYZE {s}.dead_letter"]

#: the rows LOAD inserts into message_store's generations and into dead_letter
#: (a plain table is its own only leaf; pg_partition_tree lists nothing for it)
INSERTED = "SELECT coalesce(sum(t.n_tup_ins), 0) FROM pg_stat_user_tables AS t "
INSERTED += "WHERE t.relid = %(t)s::regclass OR t.relid IN "
INSERTED += "(SELECT relid FROM pg_partition_tree(%(t)s::regclass) WHERE isleaf)"


def _inserts_counted(conn: psycopg.Connection, schema: str) -> bool:
    """Whether the statistics hold every insert of LOAD. A session reports its counts
    at most once a second: reported after the VACUUM ANALYZE, the inserts would add
    themselves to the live rows it counted, and the estimates would read double."""
    counted = [
        conn.execute(INSERTED, {"t": f'"{schema}".{table}'}).fetchone()[0]  # type: ignore[index]
        for table in ("message_store", "dead_letter")
    ]
    return counted == [62_000, 3_000]


@pytest.fixture(scope="module")
def loaded(dsn: str) -> Iterator[tuple[psycopg.Connection, str]]:
    schema = f"t_mplan_{uuid.uuid4().hex[:8]}"
    ident = sql.Identifier(schema)
    with psycopg.connect(dsn, autocommit=True) as conn:
        migrate(conn, schema)
        try:
            for statement in LOAD:
                conn.execute(sql.SQL(statement.replace("%%", "%")).format(s=ident))
            wait_for(lambda: _inserts_counted(conn, schema), 30, "the inserts in the statistics")
            for statement in ANALYZE:
                conn.execute(sql.SQL(statement).format(s=ident))
            yield conn, schema
        finally:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(ident))


def _explain(conn: psycopg.Connection, schema: str, name: str, cap: int) -> list[dict[str, Any]]:
    query = sql.SQL("EXPLAIN (FORMAT JSON) ") + queries(schema)[name]
    row = conn.execute(query, {"schema": schema, "cap": cap, "now": None}).fetchone()
    assert row is not None
    return list(plans.nodes(row[0][0]["Plan"]))


def _scanned(nodes: list[dict[str, Any]]) -> list[str]:
    return [
        n["Relation Name"]
        for n in nodes
        if n["Node Type"] in ("Seq Scan", "Sample Scan") and _broker_table(n.get("Relation Name"))
    ]


@pytest.mark.parametrize("cap", [DEFAULT_CAP, 100])
def test_queue_depths_walks_indexes_only(loaded: tuple[psycopg.Connection, str], cap: int) -> None:
    conn, schema = loaded

    nodes = _explain(conn, schema, "queue_depths", cap)

    assert _scanned(nodes) == []
    indexes = plans.indexes(conn, nodes)
    assert {"message_store_ready_idx", "message_store_due_idx", "dead_letter_queue_idx"} <= indexes
    # the oldest-ready lookup in id order must not walk the primary key past other queues
    assert "message_store_pkey" not in indexes
    # and the cost estimate stays below jit_above_cost's default: JIT would cost seconds
    assert nodes[0]["Total Cost"] < 100_000


def test_table_sizes_reads_only_the_catalog(loaded: tuple[psycopg.Connection, str]) -> None:
    conn, schema = loaded

    nodes = _explain(conn, schema, "table_sizes", DEFAULT_CAP)

    assert not [n for n in nodes if _broker_table(n.get("Relation Name"))]


def test_queue_depths_on_the_loaded_table(loaded: tuple[psycopg.Connection, str]) -> None:
    conn, schema = loaded
    rows = conn.execute(
        queries(schema)["queue_depths"], {"schema": schema, "cap": DEFAULT_CAP, "now": None}
    ).fetchall()
    by_queue = {row[0]: row for row in rows}

    assert len(by_queue) == 41
    # 55,000 in "bulk" are above the cap: an estimate, from statistics of the whole table
    bulk = by_queue["bulk"]
    assert bulk[5] is False
    assert 50_000 < bulk[1] + bulk[2] < 60_000
    assert bulk[2] == 50  # every leased message is at the front of the delivery order
    assert sum(row[3] for row in rows) == 2000  # delayed: 2,000 <= the cap, exact
    assert sum(row[4] for row in rows) == 3000
