"""The broker with least-privileged roles, as docs/operations.md describes them.

* an owner role that may create a schema in the database, owns the broker schema and
  runs the migrations;
* an app role (publishes) and a worker role (consumes): the grants in operations.md's
  ``sql`` block, read from the page itself, nothing more, ``auto_migrate`` off.

Roles are cluster-wide, so each test makes its own with unique names and drops them.
Also: a password never shows in errors, logs or ``repr``.
"""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import psycopg
import pytest
from helpers import row_count
from kombu import Connection, Consumer, Exchange, Producer, Queue
from psycopg import errors, sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from waiting import wait_for

import kombu_pgqueue
from kombu_pgqueue import PrivilegeError
from kombu_pgqueue.embedded import broker_url
from kombu_pgqueue.migrations import latest_version

SECRET = "S3cr3t-pw_" + uuid.uuid4().hex[:8]
OPERATIONS = Path(__file__).resolve().parents[2] / "docs" / "operations.md"


@dataclass
class Roles:
    owner: str
    app: str
    worker: str
    dsn: str

    def dsn_for(self, role: str, **extra: str) -> str:
        params = conninfo_to_dict(self.dsn) if self.dsn else {}
        params.update(user=role, **extra)
        return make_conninfo(**params)

    def url_for(self, role: str) -> str:
        return broker_url(self.dsn_for(role))


def _ident(name: str) -> sql.Identifier:
    return sql.Identifier(name)


def documented_grants(conn: psycopg.Connection, schema: str, role: str) -> list[str]:
    """The statements of the ``sql`` block under "## Privileges" in docs/operations.md,
    for ``schema``, ``role`` and ``conn``'s database instead of the page's ``pgqueue``,
    ``worker`` and ``app``."""
    section = OPERATIONS.read_text(encoding="utf-8").split("## Privileges", 1)[1]
    block = section.split("```sql\n", 1)[1].split("```", 1)[0]
    block = re.sub(r"--.*", "", block)
    dbname = conn.execute("SELECT current_database()").fetchone()[0]  # type: ignore[index]
    names = {"pgqueue": schema, "worker": role, "app": dbname}
    block = re.sub(
        r"\b(pgqueue|worker|app)\b", lambda m: _ident(names[m[1]]).as_string(conn), block
    )
    return [" ".join(part.split()) for part in block.split(";") if part.strip()]


@pytest.fixture
def roles(dsn: str, db: psycopg.Connection, schema: str) -> Iterator[Roles]:
    tag = uuid.uuid4().hex[:10]
    made = Roles(f"pgq_owner_{tag}", f"pgq_app_{tag}", f"pgq_worker_{tag}", dsn)
    dbname = db.execute("SELECT current_database()").fetchone()[0]  # type: ignore[index]
    try:
        for role in (made.owner, made.app, made.worker):
            db.execute(
                sql.SQL("CREATE ROLE {} LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE").format(
                    _ident(role)
                )
            )
        db.execute(
            sql.SQL("GRANT CREATE ON DATABASE {} TO {}").format(_ident(dbname), _ident(made.owner))
        )
        # the owner installs the schema and grants exactly what operations.md lists
        kombu_pgqueue.migrate(made.dsn_for(made.owner), schema)
        with psycopg.connect(made.dsn_for(made.owner), autocommit=True) as owner:
            for role in (made.app, made.worker):
                for statement in documented_grants(owner, schema, role):
                    if "ON DATABASE" not in statement:  # the database's owner grants that
                        owner.execute(statement)
        yield made
    finally:
        for role in (made.app, made.worker, made.owner):
            exists = db.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (role,)).fetchone()
            if exists:
                # drops the schema the owner owns and revokes every grant, then the role
                db.execute(sql.SQL("DROP OWNED BY {} CASCADE").format(_ident(role)))
                db.execute(sql.SQL("DROP ROLE {}").format(_ident(role)))


def _connect(roles: Roles, role: str, schema: str) -> Connection:
    conn = Connection(
        roles.url_for(role),
        transport_options={
            "schema": schema,
            "auto_migrate": False,
            "polling_interval": 0.5,
            "batch_acks": False,
        },
    )
    conn.connect()
    return conn


def test_the_roles_are_not_superusers_and_the_owner_owns_the_schema(
    roles: Roles, db: psycopg.Connection, schema: str
) -> None:
    rows = db.execute(
        "SELECT rolname, rolsuper, rolcreatedb, rolcreaterole FROM pg_roles "
        "WHERE rolname = ANY(%s) ORDER BY rolname",
        ([roles.owner, roles.app, roles.worker],),
    ).fetchall()
    assert [r[1:] for r in rows] == [(False, False, False)] * 3
    owner = db.execute(
        "SELECT pg_get_userbyid(nspowner) FROM pg_namespace WHERE nspname = %s", (schema,)
    ).fetchone()
    assert owner == (roles.owner,)


def test_app_publishes_and_worker_consumes_acks_requeues_and_dead_letters(
    roles: Roles, db: psycopg.Connection, schema: str
) -> None:
    app = _connect(roles, roles.app, schema)
    worker = _connect(roles, roles.worker, schema)
    try:
        exchange = Exchange("lp-x", "direct")
        queue = Queue("lp", exchange, routing_key="lp")
        producer = Producer(app)
        producer.publish({"n": 1}, exchange=exchange, routing_key="lp", declare=[queue])
        producer.publish({"n": 2}, routing_key="lp")
        producer.publish({"n": 3}, routing_key="lp", headers={"dedup_key": "three"})
        producer.publish({"n": 3}, routing_key="lp", headers={"dedup_key": "three"})

        got: list[int] = []

        def on_message(body: dict[str, int], message: Any) -> None:
            got.append(body["n"])
            if body["n"] == 2 and got.count(2) == 1:
                message.requeue()  # an UPDATE
            elif body["n"] == 3:
                message.reject()  # INSERT into dead_letter, DELETE from message
            else:
                message.ack()  # a DELETE

        # and a delayed message: the consumer's poll promotes it when due (an UPDATE)
        soon = datetime.now(timezone.utc) + timedelta(seconds=1)
        producer.publish({"n": 4}, routing_key="lp", headers={"eta": soon.isoformat()})

        def delivered_all() -> bool:
            try:
                worker.drain_events(timeout=1)
            except TimeoutError:
                pass
            return sorted(got) == [1, 2, 2, 3, 4]

        with Consumer(worker, [queue], callbacks=[on_message], prefetch_count=1):
            wait_for(
                delivered_all, 30, "the worker role to get all five deliveries", details=lambda: got
            )

        assert row_count(db, schema) == 0
        dead = db.execute(
            sql.SQL("SELECT reason FROM {}").format(sql.Identifier(schema, "dead_letter"))
        ).fetchall()
        assert dead == [("rejected",)]
    finally:
        app.release()
        worker.release()


@pytest.mark.parametrize(
    "statement",
    [
        "DROP TABLE {schema}.message_store",
        "DROP SCHEMA {schema} CASCADE",
        "TRUNCATE {schema}.message_store",
        "ALTER TABLE {schema}.message_store ADD COLUMN evil text",
        "CREATE TABLE {schema}.evil (id int)",
        "DROP INDEX {schema}.message_ready_idx",
        "CREATE INDEX evil_idx ON {schema}.message_store (queue)",
        # after which every process that starts would try to install the schema again
        "DELETE FROM {schema}.schema_migration",
        "UPDATE {schema}.schema_migration SET version = 0",
        "INSERT INTO {schema}.schema_migration (version, name) VALUES (9999, 'evil')",
    ],
)
@pytest.mark.parametrize("who", ["app", "worker"])
def test_app_and_worker_roles_cannot_change_the_schema(
    roles: Roles, db: psycopg.Connection, schema: str, statement: str, who: str
) -> None:
    role = getattr(roles, who)
    with psycopg.connect(roles.dsn_for(role), autocommit=True) as conn:
        query = sql.SQL(statement.replace("{schema}", "{}")).format(sql.Identifier(schema))
        with pytest.raises(errors.InsufficientPrivilege):
            conn.execute(query)
    assert row_count(db, schema) == 0
    assert db.execute(
        "SELECT count(*) FROM pg_tables WHERE schemaname = %s AND tablename = 'message'",
        (schema,),
    ).fetchone() == (1,)


def test_a_role_without_create_gets_a_privilege_error_naming_the_grant(
    roles: Roles, dsn: str
) -> None:
    fresh = f"t_{uuid.uuid4().hex[:12]}"
    conn = Connection(roles.url_for(roles.app), transport_options={"schema": fresh})
    try:
        with pytest.raises(PrivilegeError) as caught:
            conn.connect()
    finally:
        conn.release()
    text = str(caught.value)
    assert roles.app in text and fresh in text
    assert "migrate" in text  # the command to run instead


def test_auto_migrate_off_with_an_installed_schema_needs_no_owner_rights(
    roles: Roles, schema: str
) -> None:
    conn = _connect(roles, roles.worker, schema)
    try:
        assert conn.default_channel.store.size("nothing") == 0
    finally:
        conn.release()


#: tables that no role but the owner reads or writes: the owner's SECURITY DEFINER
#: functions (the dedup triggers) reach them, and docs/operations.md says so
OWNER_ONLY = ("dedup", "era", "spare")


def test_the_documented_grants_cover_every_table_and_only_read_the_migration_record(
    roles: Roles, db: psycopg.Connection, schema: str
) -> None:
    # a migration that adds a table fails this until operations.md and the advice name it
    # a partition (a generation of message_store) is reached through its table
    tables = db.execute(
        "SELECT tablename FROM pg_tables AS t"
        " JOIN pg_class AS c ON c.oid = format('%%I.%%I', t.schemaname, t.tablename)::regclass"
        " WHERE t.schemaname = %s AND NOT c.relispartition ORDER BY tablename",
        (schema,),
    ).fetchall()
    assert ("message",) in tables and ("schema_migration",) in tables
    for (table,) in tables:
        qualified = sql.Identifier(schema, table).as_string(db)
        for who in (roles.app, roles.worker):
            row = db.execute(
                "SELECT has_table_privilege(%(who)s, %(t)s, 'SELECT'),"
                " has_table_privilege(%(who)s, %(t)s, 'INSERT'),"
                " has_table_privilege(%(who)s, %(t)s, 'UPDATE'),"
                " has_table_privilege(%(who)s, %(t)s, 'DELETE'),"
                " has_table_privilege(%(who)s, %(t)s, 'TRUNCATE')",
                {"who": who, "t": qualified},
            ).fetchone()
            if table in OWNER_ONLY:  # reached only through the owner's functions
                assert row == (False, False, False, False, False), (table, who)
                continue
            # the applied versions, the key that seals handoffs, the rotation: read only
            writes = table not in ("schema_migration", "handoff_key", "rotation", "generation")
            assert row == (True, writes, writes, writes, False), (table, who)


def test_the_grants_errors_advise_are_the_documented_ones(
    db: psycopg.Connection, dsn: str, schema: str, role: str
) -> None:
    kombu_pgqueue.migrate(dsn, schema)
    conn = Connection(
        broker_url(make_conninfo(dsn, user=role)),
        transport_options={"schema": schema, "auto_migrate": False},
    )
    try:
        with pytest.raises(PrivilegeError) as caught:
            conn.connect()
    finally:
        conn.release()
    text = str(caught.value)
    advised = [" ".join(s.split()) for s in text[text.index("GRANT ") :].split(";") if s.strip()]
    documented = documented_grants(db, schema, role)
    assert advised == [s for s in documented if "ON DATABASE" not in s]


# -- passwords ---------------------------------------------------------------------------


def _wrong_credentials_url(dsn: str) -> str:
    # a role that does not exist, with a password: refused by every auth method, so
    # the error path runs whether the server trusts local connections or not
    params = conninfo_to_dict(dsn) if dsn else {}
    params.update(user=f"pgq_nobody_{uuid.uuid4().hex[:8]}", password=SECRET)
    return broker_url(make_conninfo(**params))


def test_a_refused_connection_never_shows_the_password(
    dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    url = _wrong_credentials_url(dsn)
    assert SECRET in url  # the test would prove nothing otherwise
    conn = Connection(url, transport_options={"schema": "pgq_never", "connect_timeout": 5})
    caplog.set_level(logging.DEBUG)
    try:
        with pytest.raises(psycopg.OperationalError) as caught:
            conn.connect()
        uri = conn.as_uri()
        shown = [str(caught.value), repr(caught.value), uri, repr(conn), str(conn)]
    finally:
        conn.release()

    assert "**" in uri and uri.startswith("pgqueue://")
    chained = caught.value.__cause__ or caught.value.__context__
    if chained is not None:
        shown.append(str(chained))
    shown.append(caplog.text)
    for text in shown:
        assert SECRET not in text, text


def test_the_libpq_url_form_masks_the_password_too(dsn: str) -> None:
    url = "pgqueue+" + _wrong_credentials_url(dsn).replace("pgqueue://", "postgresql://", 1)
    conn = Connection(url)
    try:
        assert SECRET not in conn.as_uri()
        assert SECRET not in repr(conn)
        with pytest.raises(psycopg.OperationalError) as caught:
            conn.connect()
        assert SECRET not in str(caught.value)
    finally:
        conn.release()


def _migrate_command(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kombu_pgqueue", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_migrate_command_never_prints_the_password(dsn: str) -> None:
    url = _wrong_credentials_url(dsn).replace("pgqueue://", "postgresql://", 1)
    done = _migrate_command("--dsn", url, "--schema", "pgq_never", "migrate")
    assert done.returncode == 2, done.stderr
    assert SECRET not in done.stdout + done.stderr
    assert "cannot connect to" in done.stderr and "pgq_nobody_" in done.stderr


def test_the_documented_migrate_command_works_and_hides_the_password(dsn: str) -> None:
    # README and operations.md put --dsn/--schema after the command; a usage error
    # from argparse would echo the whole DSN, password included
    url = _wrong_credentials_url(dsn).replace("pgqueue://", "postgresql://", 1)
    done = _migrate_command("migrate", "--dsn", url, "--schema", "pgq_never")
    assert SECRET not in done.stdout + done.stderr
    assert done.returncode == 2, done.stderr  # refused by the server, not by argparse


def test_upgrades_grant_their_tables_to_the_roles_granted_before(
    roles: Roles, db: psycopg.Connection, schema: str
) -> None:
    """The grants made for version 9 (waiter; not listener or handoff_key of 0010, nor
    message_store and its rotation of 0012) keep workers handing off, publishing and
    consuming after the upgrade: each migration grants its own tables."""
    owner = roles.dsn_for(roles.owner)
    with psycopg.connect(owner, autocommit=True) as conn:  # version 9, as it was granted
        conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))
        kombu_pgqueue.migrate(conn, schema, to=9)
        for who in (roles.app, roles.worker):
            for statement in (
                "GRANT USAGE ON SCHEMA {s} TO {r}",
                "GRANT SELECT, INSERT, UPDATE, DELETE ON {s}.queue, {s}.exchange,"
                " {s}.binding, {s}.message, {s}.dead_letter, {s}.waiter TO {r}",
                "GRANT SELECT ON {s}.schema_migration TO {r}",
            ):
                conn.execute(
                    sql.SQL(statement).format(s=sql.Identifier(schema), r=sql.Identifier(who))
                )
    assert kombu_pgqueue.migrate(owner, schema) == list(range(10, latest_version() + 1))

    for who in (roles.app, roles.worker):
        for table, privilege, granted in (
            ("listener", "INSERT", True),
            ("listener", "DELETE", True),
            ("handoff_key", "SELECT", True),
            ("handoff_key", "UPDATE", False),
            ("message_store", "INSERT", True),
            ("message_store", "DELETE", True),
            ("rotation", "SELECT", True),
            ("rotation", "UPDATE", False),
        ):
            qualified = sql.Identifier(schema, table).as_string(db)
            row = db.execute(
                "SELECT has_table_privilege(%s, %s, %s)", (who, qualified, privilege)
            ).fetchone()
            assert row == (granted,), (who, table, privilege)
    worker, app = _connect(roles, roles.worker, schema), _connect(roles, roles.app, schema)
    got: list[Any] = []
    try:
        with Consumer(worker, [Queue("up")], callbacks=[lambda body, m: got.append(m)]):
            worker.transport.consumer.deliver_pending(inline=True)
            Producer(app).publish({"n": 1}, routing_key="up")
            worker.drain_events(timeout=10)
            assert [m.delivery_info["pgqueue_handoff"] for m in got] == [True]
            got[0].ack()
    finally:
        worker.release()
        app.release()
