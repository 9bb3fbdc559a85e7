"""The cluster helper does what fault tests rely on: a standby replicates, a promoted
standby takes writes, a paused server hangs its clients, a read-only one refuses writes."""

from __future__ import annotations

import threading
from collections.abc import Callable

import psycopg
import pytest
from clusters import Cluster
from waiting import wait_for


def test_a_synchronous_standby_has_a_row_once_the_primary_commits_it(
    primary_and_standby: Callable[..., tuple[Cluster, Cluster]],
) -> None:
    primary, standby = primary_and_standby(synchronous=True)
    with primary.connect() as conn:
        conn.execute("CREATE TABLE t (x int)")
        conn.execute("INSERT INTO t VALUES (1)")
    with standby.connect() as conn:
        # synchronous_commit=on waits for the standby's flush, not its replay
        rows = wait_for(
            lambda: conn.execute("SELECT x FROM t").fetchall(),
            10,
            "the row on the standby",
            ignore=(psycopg.errors.UndefinedTable,),
        )
        assert rows == [(1,)]
        assert standby.in_recovery()


def test_a_promoted_standby_takes_writes_after_the_primary_crashed(
    primary_and_standby: Callable[..., tuple[Cluster, Cluster]],
) -> None:
    primary, standby = primary_and_standby(synchronous=False)
    with primary.connect() as conn:
        conn.execute("CREATE TABLE t (x int)")
        conn.execute("INSERT INTO t VALUES (1)")
        lsn = conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()
    assert lsn is not None
    with standby.connect() as conn:
        wait_for(
            lambda: conn.execute(
                "SELECT pg_last_wal_replay_lsn() >= %s::pg_lsn", (lsn[0],)
            ).fetchone()[0],  # type: ignore[index]
            10,
            "the standby to replay the insert",
        )
        with pytest.raises(psycopg.errors.ReadOnlySqlTransaction):
            conn.execute("INSERT INTO t VALUES (2)")
    primary.stop("immediate")
    assert not primary.running()
    standby.promote()
    with standby.connect() as conn:
        conn.execute("INSERT INTO t VALUES (2)")
        assert conn.execute("SELECT x FROM t ORDER BY x").fetchall() == [(1,), (2,)]


def test_commits_after_an_asynchronous_standby_was_cut_off_are_lost_at_a_failover(
    primary_and_standby: Callable[..., tuple[Cluster, Cluster]],
) -> None:
    primary, standby = primary_and_standby(synchronous=False)
    with primary.connect() as conn:
        conn.execute("CREATE TABLE t (x int)")
        conn.execute("INSERT INTO t VALUES (1)")
        lsn = conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()
        assert lsn is not None
        with standby.connect() as replica:
            wait_for(
                lambda: replica.execute(
                    "SELECT pg_last_wal_receive_lsn() >= %s::pg_lsn", (lsn[0],)
                ).fetchone()[0],  # type: ignore[index]
                10,
                "the standby to receive the first insert",
            )
        standby.stop_streaming()
        conn.execute("INSERT INTO t VALUES (2)")  # returns: nobody waits for the standby
    primary.stop("immediate")
    standby.promote()
    with standby.connect() as conn:
        assert conn.execute("SELECT x FROM t").fetchall() == [(1,)]


def test_a_paused_server_leaves_a_statement_unanswered_until_it_resumes(
    primary: Cluster,
) -> None:
    answered = threading.Event()
    with primary.connect() as conn:
        conn.execute("SELECT 1")
        primary.pause()

        def ask() -> None:
            conn.execute("SELECT 1")
            answered.set()

        asker = threading.Thread(target=ask, daemon=True)
        asker.start()
        try:
            wait_for(answered, 2, "a statement to a paused server to finish", never=True)
        finally:
            primary.resume()
        wait_for(answered, 10, "the statement to finish after the resume")
        asker.join()


def test_a_new_connection_to_a_paused_server_times_out(primary: Cluster) -> None:
    primary.pause()
    try:
        with pytest.raises(psycopg.OperationalError):
            primary.connect(timeout=2)
    finally:
        primary.resume()
    with primary.connect() as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)


def test_a_read_only_server_refuses_an_insert_until_it_is_writable_again(
    primary: Cluster,
) -> None:
    with primary.connect() as conn:
        conn.execute("CREATE TABLE t (x int)")
    primary.set_read_only(True)
    with primary.connect() as conn:
        with pytest.raises(psycopg.errors.ReadOnlySqlTransaction):
            conn.execute("INSERT INTO t VALUES (1)")
    primary.set_read_only(False)
    with primary.connect() as conn:
        conn.execute("INSERT INTO t VALUES (1)")


def test_destroy_removes_a_paused_cluster() -> None:
    cluster = Cluster.primary()
    cluster.pause()
    cluster.destroy()
    assert not cluster.root.exists()
    with pytest.raises(psycopg.OperationalError):
        psycopg.connect(cluster.dsn, connect_timeout=2)
