"""Connections of one process with different session settings get pools of their own.

The process shares one pool per server among its Kombu connections, and each pooled
session gets its ``statement_timeout`` as it opens. The pool used to be chosen by the
server alone: a connection with a longer timeout had its statements cancelled at the
timeout of whichever connection opened the pool first (a half-GiB publish in CI, after
other tests had opened the pool with the default 30 s), and one with a shorter timeout
did not get it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import psycopg
import pytest
from kombu import Connection, Producer, Queue
from psycopg import sql
from waiting import wait_for

from kombu_pgqueue import ServerUnavailable


def _blocked_longer_than(db: psycopg.Connection, schema: str, seconds: float) -> bool:
    """Whether a session has waited ``seconds`` for the lock on the message table."""
    row = db.execute(
        "SELECT count(*) FROM pg_locks AS l JOIN pg_stat_activity AS a USING (pid) "
        "WHERE NOT l.granted AND l.relation = %s::regclass "
        "AND clock_timestamp() - a.query_start > make_interval(secs => %s)",
        (f"{sql.Identifier(schema).as_string(db)}.message_store", seconds),
    ).fetchone()
    return bool(row and row[0])


@pytest.mark.timeout(60)
def test_each_connection_keeps_its_own_statement_timeout(
    make_connection: Callable[..., Connection], db: psycopg.Connection, schema: str
) -> None:
    short = make_connection(statement_timeout=1)
    long = make_connection(statement_timeout=600)
    for conn in (short, long):  # the schema, the queue and each pool are there
        Producer(conn).publish({"n": 0}, routing_key="q", declare=[Queue("q")])
    lock = sql.SQL("LOCK TABLE {} IN ACCESS EXCLUSIVE MODE").format(
        sql.Identifier(schema, "message_store")
    )

    with db.transaction():  # every publish waits for this lock until the block ends
        db.execute(lock)
        with pytest.raises((ServerUnavailable, psycopg.errors.QueryCanceled)):
            Producer(short).publish({"n": 1}, routing_key="q")  # cancelled after 1 s

        failed: list[BaseException] = []

        def publish_long() -> None:
            try:
                Producer(long).publish({"n": 2}, routing_key="q")
            except BaseException as exc:  # noqa: BLE001 - reported by the test below
                failed.append(exc)

        waiting = threading.Thread(target=publish_long)
        waiting.start()
        # past the short connection's timeout, the long one's publish still waits
        wait_for(
            lambda: _blocked_longer_than(db, schema, 2.0) or failed,
            30,
            "the long connection's publish to wait past the short one's timeout",
        )
    waiting.join(30)

    assert failed == []
    assert not waiting.is_alive()
