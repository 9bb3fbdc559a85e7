"""migrate / current_version, auto_migrate, and what a locked-down role is told."""

from __future__ import annotations

import socket
import sys
import threading
from collections.abc import Callable
from contextlib import ExitStack

import psycopg
import pytest
from helpers import connected
from kombu import Connection
from psycopg import sql

from kombu_pgqueue import PrivilegeError, SchemaError, current_version, migrate
from kombu_pgqueue.__main__ import main
from kombu_pgqueue.migrations import latest_version

COMMAND = "python -m kombu_pgqueue migrate"


def _schema_exists(db: psycopg.Connection, schema: str) -> bool:
    row = db.execute("SELECT count(*) FROM pg_namespace WHERE nspname = %s", (schema,)).fetchone()
    return row == (1,)


def test_migrate_applies_every_version_once(dsn: str, schema: str, db: psycopg.Connection) -> None:
    assert current_version(db, schema) == 0

    assert migrate(dsn, schema) == list(range(1, latest_version() + 1))
    assert migrate(dsn, schema) == []
    assert current_version(db, schema) == latest_version()


def test_migrate_from_many_processes_at_once_applies_once(dsn: str, schema: str) -> None:
    results: list[list[int]] = []
    errors: list[BaseException] = []
    start = threading.Barrier(6)

    def run() -> None:
        try:
            start.wait(timeout=10)
            results.append(migrate(dsn, schema))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)

    assert errors == []
    assert sorted(results) == [[]] * 5 + [list(range(1, latest_version() + 1))]


def test_connect_installs_the_schema_by_default(
    url_with: Callable[..., str], schema: str, db: psycopg.Connection
) -> None:
    conn = connected(url_with(), schema=schema)
    try:
        assert current_version(db, schema) == latest_version()
    finally:
        conn.release()


def test_auto_migrate_off_on_a_missing_schema_raises_schema_error(
    url_with: Callable[..., str], schema: str, db: psycopg.Connection
) -> None:
    with pytest.raises(SchemaError) as caught:
        connected(url_with(), schema=schema, auto_migrate=False)

    message = str(caught.value)
    assert COMMAND in message
    assert schema in message
    assert not _schema_exists(db, schema)
    # where Celery runs (the suite imports it), its command first: the app knows the DSN
    assert "celery" in sys.modules
    assert "celery -A <your app> pgqueue migrate" in message


def test_auto_migrate_off_after_the_migrate_command_connects(
    url_with: Callable[..., str], dsn: str, schema: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--dsn", dsn, "--schema", schema, "migrate"]) == 0
    out = capsys.readouterr().out
    with psycopg.connect(dsn) as db:  # the command says where it migrated
        info = db.info
        assert out.startswith(
            f"schema {schema!r} in database {info.dbname!r} on {info.host}:{info.port} "
            f"as {info.user}: applied 1, "
        ), out

    conn = connected(url_with(), schema=schema, auto_migrate=False)
    try:
        queue = conn.SimpleQueue("after-migrate")
        queue.put({"ok": True})
        assert queue.get(timeout=5).payload == {"ok": True}
        queue.close()
    finally:
        conn.release()


def test_schema_dropped_under_a_running_transport_raises_schema_error(
    connection: Connection, db: psycopg.Connection, schema: str
) -> None:
    store = connection.default_channel.store
    db.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))

    with pytest.raises(SchemaError, match=COMMAND):
        store.size("q")


def test_role_without_create_gets_privilege_error_naming_role_and_command(
    url_with: Callable[..., str], role: str, schema: str, db: psycopg.Connection
) -> None:
    # PUBLIC has CONNECT and TEMPORARY on a database, not CREATE
    row = db.execute(
        "SELECT has_database_privilege(%s, current_database(), 'CREATE')", (role,)
    ).fetchone()
    assert row == (False,)

    with pytest.raises(PrivilegeError) as caught:
        connected(url_with(user=role), schema=schema)

    message = str(caught.value)
    assert role in message
    assert COMMAND in message
    assert schema in message
    assert not _schema_exists(db, schema)


def test_role_without_schema_usage_gets_privilege_error(
    url_with: Callable[..., str], role: str, dsn: str, schema: str
) -> None:
    migrate(dsn, schema)  # installed by its owner; the role was never granted anything

    with pytest.raises(PrivilegeError) as caught:
        connected(url_with(user=role), schema=schema, auto_migrate=False)

    assert role in str(caught.value) or schema in str(caught.value)


def test_role_without_table_privileges_gets_privilege_error_on_publish(
    url_with: Callable[..., str], role: str, dsn: str, schema: str, db: psycopg.Connection
) -> None:
    migrate(dsn, schema)
    ident, who = sql.Identifier(schema), sql.Identifier(role)
    db.execute(sql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(ident, who))
    db.execute(sql.SQL("GRANT SELECT ON {}.schema_migration TO {}").format(ident, who))

    conn = connected(url_with(user=role), schema=schema, auto_migrate=False)
    try:
        with pytest.raises(PrivilegeError, match=schema) as caught:
            conn.default_channel.store.size("q")
    finally:
        conn.release()
    assert f"role {role!r} may not run 'size'" in str(caught.value)
    assert "docs/operations.md" in str(caught.value)  # where the grants are


def test_a_role_that_may_not_upgrade_the_schema_is_told_its_owner(
    url_with: Callable[..., str], role: str, dsn: str, schema: str, db: psycopg.Connection
) -> None:
    migrate(dsn, schema)
    owner = db.execute("SELECT current_user").fetchone()
    ident, who = sql.Identifier(schema), sql.Identifier(role)
    db.execute(sql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(ident, who))
    db.execute(sql.SQL("GRANT SELECT ON {}.schema_migration TO {}").format(ident, who))
    latest = sql.SQL("DELETE FROM {}.schema_migration WHERE version = %s").format(ident)
    db.execute(latest, (latest_version(),))  # as if a release with a new migration came

    with pytest.raises(PrivilegeError) as caught:
        connected(url_with(user=role), schema=schema)  # auto_migrate on: it tries

    message = str(caught.value)
    assert f"role {role!r} may not upgrade the pgqueue schema {schema!r}" in message
    assert owner is not None and f"it is owned by {owner[0]!r}" in message
    assert COMMAND in message
    assert "GRANT CREATE ON DATABASE" not in message  # which would not help
    assert "\n" not in message and "\n" not in repr(message)  # one line, no LINE/^ excerpt


def test_every_generation_of_the_message_storage_is_set_up_for_churn(
    dsn: str, schema: str, db: psycopg.Connection
) -> None:
    migrate(dsn, schema)

    row = db.execute(
        "SELECT c.reloptions FROM pg_class AS c JOIN pg_inherits AS i ON i.inhrelid = c.oid"
        " WHERE i.inhparent = %s::regclass ORDER BY c.relname DESC LIMIT 1",
        (f"{sql.Identifier(schema).as_string(db)}.message_store",),
    ).fetchone()

    assert row is not None
    options = dict(option.split("=", 1) for option in row[0])
    assert options["vacuum_truncate"] == "false"
    assert float(options["autovacuum_vacuum_scale_factor"]) <= 0.01
    assert options["autovacuum_vacuum_cost_delay"] == "0"
    assert options["fillfactor"] == "50"


def _update_counts(db: psycopg.Connection, schema: str) -> tuple[int, int]:
    db.execute("SELECT pg_stat_clear_snapshot()")
    row = db.execute(
        "SELECT sum(n_tup_upd), sum(n_tup_hot_upd) FROM pg_stat_user_tables"
        " WHERE schemaname = %s AND relname LIKE 'message\\_store\\_%%'",
        (schema,),
    ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


def test_claims_renewals_and_requeues_are_hot_updates(
    broker_base_url: str, schema: str, db: psycopg.Connection
) -> None:
    """No index entry per claim: every update on the delivery path stays on its page."""
    from kombu_pgqueue._store import Outgoing, new_lease

    delivered = 40
    conn = connected(broker_base_url, schema=schema)
    try:
        store = conn.default_channel.store
        for _ in range(delivered):
            store.publish(Outgoing(queue="q", body=b"x" * 500, headers="{}", properties="{}"))
        lease = new_lease()
        claimed = store.claim("q", delivered, lease)
        assert len(claimed) == delivered
        ids = [d.id for d in claimed]
        assert store.renew(ids, [lease] * delivered) == set(ids)
        assert store.requeue(ids[0], lease)
        # every backend of the pool reports its statistics before it answers this
        with ExitStack() as held:
            pooled = [
                held.enter_context(store.pool.connection())
                for _ in range(store.pool.get_stats()["pool_size"])
            ]
            for pooled_conn in pooled:
                pooled_conn.execute("SELECT pg_stat_force_next_flush()")
    finally:
        conn.release()

    updates = 2 * delivered + 1  # claim, renew, requeue
    assert _update_counts(db, schema) == (updates, updates)


def test_the_migrate_command_takes_a_broker_url(
    broker_base_url: str, schema: str, db: psycopg.Connection, capsys: pytest.CaptureFixture[str]
) -> None:
    assert broker_base_url.startswith("pgqueue")

    assert main(["--dsn", broker_base_url, "--schema", schema, "migrate"]) == 0

    assert _schema_exists(db, schema)
    assert "applied" in capsys.readouterr().out


@pytest.mark.parametrize(
    "partial", [{}, {"PGUSER": "postgres", "PGPORT": "5432"}], ids=["nothing", "user-and-port"]
)
def test_the_migrate_command_refuses_to_guess_the_database(
    partial: dict[str, str],
    dsn: str,
    schema: str,
    db: psycopg.Connection,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Without --dsn, $PGQUEUE_DSN or libpq's variables, libpq would connect to its
    default database (the local socket, a database named as the user): a schema created
    where nobody meant it."""
    for name in ("PGQUEUE_DSN", "PGHOST", "PGHOSTADDR", "PGPORT", "PGDATABASE", "PGUSER",
                 "PGSERVICE"):  # fmt: skip
        monkeypatch.delenv(name, raising=False)
    for name, value in partial.items():  # a role and a port still leave libpq to guess
        monkeypatch.setenv(name, value)
    assert main(["--schema", schema, "migrate"]) == 2
    assert "name the database to migrate" in capsys.readouterr().err
    assert not _schema_exists(db, schema)


def test_the_version_command_says_what_to_do_and_check_fails_unless_current(
    dsn: str, schema: str, db: psycopg.Connection, capsys: pytest.CaptureFixture[str]
) -> None:
    def version(*check: str) -> tuple[int, str]:
        status = main(["--dsn", dsn, "--schema", schema, "version", *check])
        return status, capsys.readouterr().out.rstrip().split(": ", 1)[1]

    latest = latest_version()
    missing = f"not installed, code needs {latest}: run python -m kombu_pgqueue migrate"
    assert version() == (0, missing)  # what a deploy script calling it had
    assert version("--check") == (1, missing)

    migrate(dsn, schema)
    assert version("--check") == (0, f"version {latest}, current")

    newer = sql.SQL("INSERT INTO {} (version, name) VALUES (%s, 'later')").format(
        sql.Identifier(schema, "schema_migration")
    )
    db.execute(newer, (latest + 1,))  # a later release migrated it
    later = f"version {latest + 1}, newer than this code ({latest}): upgrade kombu-pgqueue"
    assert version("--check") == (1, later)


def test_the_sql_command_on_a_server_that_cannot_be_reached_is_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    nowhere = f"host=127.0.0.1 port={port} dbname=x user=x connect_timeout=5"

    assert main(["--dsn", nowhere, "sql"]) == 2

    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("cannot connect to "), line


def test_an_upgrade_behind_a_dump_stops_with_its_holder_named_and_changes_nothing(
    dsn: str, schema: str, db: psycopg.Connection
) -> None:
    """Migration 0015 replaces a trigger of message_store, which takes its exclusive lock
    for a moment. Behind a pg_dump (which holds ACCESS SHARE until it ends) it would wait,
    and every claim and publish would queue behind it: it gives up after lock_timeout,
    names who holds the table, and the next try, once the reader ended, applies it."""
    assert migrate(dsn, schema, to=14)[-1] == 14
    with psycopg.connect(dsn) as reader, psycopg.connect(dsn) as owner:
        reader.execute(
            sql.SQL("SELECT 1 FROM {}.message_store LIMIT 0").format(sql.Identifier(schema))
        )
        reader_pid = reader.info.backend_pid
        owner.execute("SET lock_timeout = '100ms'")
        owner.commit()
        with pytest.raises(psycopg.errors.LockNotAvailable) as raised:
            migrate(owner, schema)
        assert f"{reader_pid} (" in str(raised.value)
        assert "Run migrate again" in (raised.value.diag.message_hint or "")
        owner.rollback()
        assert current_version(db, schema) == 14
        reader.rollback()  # the dump ends
        assert migrate(owner, schema, to=15) == [15]
    assert current_version(db, schema) == 15
