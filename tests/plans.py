"""Reading EXPLAIN (FORMAT JSON) plans of the broker's statements.

Messages live in generations, partitions of ``message_store`` (migration 0012): a plan
reads each generation's own copy of an index, named after the partition. These helpers
name an index by the index of ``message_store`` it belongs to, and leave out of the
sequential scans those that read nothing: a sequence (one row: the current generation),
table ``rotation`` (one row) and an empty table (the generation attached ahead).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
from psycopg import sql

from kombu_pgqueue._pool import SESSION_SETTINGS
from kombu_pgqueue._sql import positional


def nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every node of ``plan`` (the "Plan" of an EXPLAIN), depth first."""
    yield plan
    for child in plan.get("Plans", []):
        yield from nodes(child)


def seq_scans(conn: psycopg.Connection, found: list[dict[str, Any]]) -> list[str]:
    """The tables with rows in them that ``found`` (plan nodes) reads whole."""
    names = [n.get("Relation Name", "?") for n in found if n["Node Type"] == "Seq Scan"]
    nothing = {
        name
        for (name,) in conn.execute(
            "SELECT relname FROM pg_class WHERE relname = ANY(%s)"
            " AND (relpages = 0 OR relkind = 'S')",
            (names,),
        )
    }
    return [name for name in names if name != "rotation" and name not in nothing]


def indexes(conn: psycopg.Connection, found: list[dict[str, Any]]) -> set[str]:
    """The indexes ``found`` reads, a generation's by the name of message_store's."""
    names = {n["Index Name"] for n in found if "Index Name" in n}
    parents = conn.execute(
        "SELECT c.relname, p.relname FROM pg_class AS c"
        " JOIN pg_class AS p ON p.oid = pg_partition_root(c.oid)"
        " WHERE c.relname = ANY(%s)",
        (list(names),),
    ).fetchall()
    return {dict(parents).get(name, name) for name in names}


def generic_plan(conn: psycopg.Connection, schema: str, name: str, params: dict[str, Any]) -> Any:
    """The generic plan of statement ``name`` (EXPLAIN (FORMAT JSON)'s row), the plan the
    broker's own sessions run (they plan each prepared statement once:
    ``SESSION_SETTINGS``): PREPAREd as the pipeline sends it (``$n`` for each key), and
    EXPLAIN EXECUTE with ``params`` as literals, in a new session of those settings."""
    text, keys = positional(schema, name)
    with psycopg.connect(conn.info.dsn, autocommit=True) as session:
        session.execute(SESSION_SETTINGS)
        session.execute(b"PREPARE plan_check AS " + text)
        values = sql.SQL(", ").join(sql.Literal(params[key]) for key in keys)
        explain = sql.SQL("EXPLAIN (FORMAT JSON) EXECUTE plan_check({})").format(values)
        row = session.execute(explain).fetchone()
        # planned for no values (without plan_cache_mode, the first five executions of
        # a prepared statement are planned for theirs)
        kinds = session.execute(
            "SELECT generic_plans, custom_plans FROM pg_prepared_statements"
            " WHERE name = 'plan_check'"
        ).fetchone()
    assert kinds == (1, 0), kinds
    assert row is not None
    return row
