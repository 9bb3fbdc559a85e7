"""Query-plan regression: the hot statements walk indexes, never the whole message table.

20,000 ready messages over 50 queues plus delayed ones (a few of them due), then
ANALYZE, then ``EXPLAIN (FORMAT JSON)`` of each statement as the store sends it.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import Any

import plans
import psycopg
import pytest
from psycopg import sql

from kombu_pgqueue import migrate
from kombu_pgqueue._options import parse_options
from kombu_pgqueue._sql import queries
from kombu_pgqueue._store import Outgoing, Store

READY = 20_000
QUEUES = 50


@contextmanager
def _plan_schema(dsn: str) -> Iterator[tuple[psycopg.Connection, str, Store, datetime]]:
    """A freshly migrated schema of its own, dropped afterwards."""
    schema = f"t_plan_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        migrate(conn, schema)
        try:
            now = conn.execute("SELECT now()").fetchone()[0]  # type: ignore[index]
            yield conn, schema, Store(dsn, parse_options({"schema": schema})), now
        finally:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


@pytest.fixture(scope="module")
def loaded(dsn: str) -> Iterator[tuple[psycopg.Connection, str, datetime]]:
    with _plan_schema(dsn) as (conn, schema, store, now):
        messages = [
            Outgoing(
                queue=f"q{i % QUEUES}", body=b"x", headers="{}", properties="{}", priority=i % 4
            )
            for i in range(READY)
        ]
        messages += [
            Outgoing(
                queue=f"q{i % QUEUES}",
                body=b"x",
                headers="{}",
                properties="{}",
                eta=now + timedelta(seconds=2 if i < 5 else 3600),
            )
            for i in range(200)
        ]
        assert store.publish_many(messages) == len(messages)
        conn.execute(sql.SQL("ANALYZE {}.message_store").format(sql.Identifier(schema)))
        yield conn, schema, now


def _explain(
    conn: psycopg.Connection,
    schema: str,
    name: str,
    params: dict[str, Any],
    *,
    generic: bool = False,
) -> list[dict[str, Any]]:
    """The plan of statement ``name`` for ``params``: planned for these values, or
    (``generic``) the generic plan that the broker's own sessions run (they plan each
    prepared statement once: SESSION_SETTINGS), in a session of those settings."""
    if not generic:
        query = sql.SQL("EXPLAIN (FORMAT JSON) ") + queries(schema)[name]
        row = conn.execute(query, params).fetchone()
    else:
        row = plans.generic_plan(conn, schema, name, params)
    assert row is not None
    return list(plans.nodes(row[0][0]["Plan"]))


def _params(name: str, now: datetime) -> dict[str, Any]:
    lease = {"lease": 42, "lease_seconds": 60.0, "synchronous_commit": "off"}
    # every statement on messages reads the generations from the floor on (the schema's
    # first generation: all of them)
    return {"floor": 1} | {
        "claim": {
            "queue": "q7",
            "limit": 10,
            "max_attempts": 5,
            "now": None,
            "after_priority": None,
            "after_id": None,
            **lease,
        },
        "take": {"queue": "q7", "limit": 10, "now": None},
        "poll": {
            "queues": ["q1", "q2"],
            "check": ["q1", "q2"],
            "now": now + timedelta(seconds=10),
            "channel": "c",
        },
        "ack": {"id": 123, "lease": 42, "synchronous_commit": "off"},
        "ack_many": {"ids": [1, 2, 3], "leases": [42, 42, 42], "synchronous_commit": "off"},
        "renew": {"ids": [1, 2, 3], "leases": [42, 42, 42], "now": None, **lease},
        "requeue": {
            "id": 123,
            "lease": 42,
            "channel": "c",
            "synchronous_commit": "off",
            "now": now,
        },
        "bury": {
            "id": 123,
            "lease": 42,
            "reason": "rejected",
            "error": None,
            "synchronous_commit": "off",
        },
    }[name]


@pytest.mark.parametrize("generic", [False, True], ids=["custom", "generic"])
@pytest.mark.parametrize("name", ["claim", "take"])
def test_claim_uses_the_ready_index_and_no_seq_scan(
    loaded: tuple[psycopg.Connection, str, datetime], name: str, generic: bool
) -> None:
    conn, schema, now = loaded

    nodes = _explain(conn, schema, name, _params(name, now), generic=generic)

    assert plans.seq_scans(conn, nodes) == []
    assert "message_store_ready_idx" in plans.indexes(conn, nodes)


@pytest.mark.parametrize("generic", [False, True], ids=["custom", "generic"])
@pytest.mark.parametrize("name", ["ack", "ack_many", "renew", "requeue", "bury"])
def test_per_message_statements_find_rows_by_primary_key(
    loaded: tuple[psycopg.Connection, str, datetime], name: str, generic: bool
) -> None:
    conn, schema, now = loaded

    nodes = _explain(conn, schema, name, _params(name, now), generic=generic)

    assert plans.seq_scans(conn, nodes) == []
    assert "message_store_pkey" in plans.indexes(conn, nodes)


@pytest.mark.parametrize("generic", [False, True], ids=["custom", "generic"])
def test_poll_with_due_delayed_messages_has_no_seq_scan(
    loaded: tuple[psycopg.Connection, str, datetime], generic: bool
) -> None:
    # every consumer runs the poll every polling_interval; with any delayed message
    # due it must not read the whole message table to promote a handful of rows
    conn, schema, now = loaded

    nodes = _explain(conn, schema, "poll", _params("poll", now), generic=generic)

    assert plans.seq_scans(conn, nodes) == []
    assert "message_store_due_idx" in plans.indexes(conn, nodes)


@pytest.fixture(scope="module")
def believed_empty(dsn: str) -> Iterator[tuple[psycopg.Connection, str, datetime]]:
    """6,000 messages in a table whose statistics say it is empty.

    That is what autovacuum leaves after it ran while consumers had drained the queue:
    zero live rows over the pages the table kept, so the planner estimates any size of
    it at a density of zero rows per page, i.e. one row.
    """
    with _plan_schema(dsn) as (conn, schema, store, now):
        ident = sql.Identifier(schema)
        batch = [
            Outgoing(queue=f"q{i % 5}", body=b"x" * 200, headers="{}", properties="{}")
            for i in range(6_000)
        ]
        store.publish_many(batch)
        conn.execute(sql.SQL("DELETE FROM {}.message_store").format(ident))
        conn.execute(sql.SQL("VACUUM {}.message_store").format(ident))
        store.publish_many(batch)
        row = conn.execute(
            "SELECT reltuples FROM pg_class WHERE oid = %s::regclass",
            (f"{ident.as_string(conn)}.message_store_1",),  # the current generation
        ).fetchone()
        assert row == (0.0,)
        yield conn, schema, now


_JOINS = ("Nested Loop", "Hash Join", "Merge Join")


@pytest.mark.parametrize("generic", [False, True], ids=["custom", "generic"])
@pytest.mark.parametrize("name", ["claim", "take", "ack_many", "renew", "release"])
def test_statements_given_a_list_of_ids_reach_it_by_key_whatever_the_estimate(
    believed_empty: tuple[psycopg.Connection, str, datetime], name: str, generic: bool
) -> None:
    conn, schema, now = believed_empty
    params = _params("renew" if name == "release" else name, now)
    if name == "release":
        params = {k: params[k] for k in ("ids", "leases", "synchronous_commit", "now", "floor")}
        params["channel"] = "c"
        params["uncount"] = True

    nodes = _explain(conn, schema, name, params, generic=generic)

    # not the generation attached ahead: empty, its scan reads no page
    empty = {f"message_store_{gen}" for gen in (2,)}
    scans = [
        n
        for n in nodes
        if n.get("Relation Name", "").startswith("message_store")
        and n["Relation Name"] not in empty
        and n["Node Type"].endswith("Scan")
    ]
    assert scans
    for scan in scans:
        assert scan["Node Type"] != "Seq Scan", scan
        # an index scan without a condition reads the whole index: every message
        assert "Index Cond" in scan, scan
    # and no join of the messages to the list: the table went whole into the join
    # believed empty, and the generic plan probed the key once per id with the whole
    # list (see ack_many). The claim's call of bury_exhausted, a join of its list to the
    # function, reads no message itself.
    joins = [
        n["Node Type"]
        for n in nodes
        if n["Node Type"] in _JOINS
        and any(m.get("Relation Name", "").startswith("message_store") for m in plans.nodes(n))
    ]
    assert joins == [], joins


def test_the_brokers_own_sessions_plan_without_sequential_scans(store: Store) -> None:
    with store.pool.connection() as conn:
        assert conn.execute("SHOW enable_seqscan").fetchone() == ("off",)
        assert conn.execute("SHOW jit").fetchone() == ("off",)
        assert conn.execute("SHOW plan_cache_mode").fetchone() == ("force_generic_plan",)


@pytest.mark.parametrize("exhausted", [False, True], ids=["none exhausted", "one exhausted"])
def test_a_claim_deletes_only_when_a_candidate_had_its_max_attempts(
    dsn: str, exhausted: bool
) -> None:
    """A DELETE on message_store, even of no row, runs its statement trigger
    (dedup_release, migration 0015): the claim calls bury_exhausted, which deletes the
    candidates that had their max_attempts, only when there are some."""
    with _plan_schema(dsn) as (conn, schema, store, now):
        store.publish_many(
            [Outgoing(queue="q7", body=b"x", headers="{}", properties="{}") for _ in range(3)]
        )
        params = _params("claim", now) | {"max_attempts": 0 if exhausted else 5}
        query = sql.SQL("EXPLAIN (ANALYZE, FORMAT JSON) ") + queries(schema)["claim"]
        with conn.transaction(force_rollback=True):
            row = conn.execute(query, params).fetchone()
        assert row is not None
        calls = [
            n["Actual Loops"]
            for n in plans.nodes(row[0][0]["Plan"])
            if n.get("Function Name") == "bury_exhausted"
        ]
        assert calls == [1 if exhausted else 0]
