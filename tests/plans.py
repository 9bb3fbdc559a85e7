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
