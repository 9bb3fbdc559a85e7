"""Small helpers shared by the test directories: gates that tasks in worker processes
wait on, and counts (rows of a table, the transport's event counters).

Importable from every test directory and from worker processes, like ``waiting``.
"""

from __future__ import annotations

import psycopg
from psycopg import sql
from waiting import wait_for

from kombu_pgqueue import admin

#: transport options under which every claim counts as slow (it resumes after its last
#: message) and the period of resuming never ends within a test
ALWAYS_RESUMED = {"slow_claim_seconds": 0.0, "resume_seconds": 3600.0}


def open_gate(conn: psycopg.Connection, schema: str, name: str, *, table: str = "gate") -> None:
    """Open gate ``name``: a row in ``schema.table`` (``name text PRIMARY KEY``); again: no-op."""
    conn.execute(
        sql.SQL("INSERT INTO {} (name) VALUES (%s) ON CONFLICT DO NOTHING").format(
            sql.Identifier(schema, table)
        ),
        (name,),
    )


def wait_gate(dsn: str, schema: str, name: str, timeout: float, *, table: str = "gate") -> None:
    """Wait until gate ``name`` is open (:func:`open_gate`); fail after ``timeout`` seconds."""
    query = sql.SQL("SELECT 1 FROM {} WHERE name = %s").format(sql.Identifier(schema, table))
    with psycopg.connect(dsn, autocommit=True) as conn:
        wait_for(lambda: conn.execute(query, (name,)).fetchone(), timeout, f"gate {name!r}")


def row_count(db: psycopg.Connection, schema: str, table: str = "message_store") -> int:
    """How many rows ``schema.table`` has, as ``db`` sees them."""
    row = db.execute(
        sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(schema, table))
    ).fetchone()
    assert row is not None
    return int(row[0])


def counter(event: str, queue: str = "") -> int:
    """This process's count of ``event`` on ``queue`` (:func:`kombu_pgqueue.admin.counters`)."""
    return admin.counters().get((event, queue), 0)
