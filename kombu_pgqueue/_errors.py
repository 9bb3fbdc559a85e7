"""The one place that turns PostgreSQL's errors (SQLSTATEs) into pgqueue's.

A missing table means a missing or partly dropped schema (:class:`SchemaError`, naming
the migrate command), and a table in the way of one a migration creates names both and
the ``schema`` option; a privilege error names what the role may not do and, where a
grant would help, the statement its owner can run (:class:`PrivilegeError`); data that
PostgreSQL refuses is the message's fault (:class:`MessageError`); a publish the server
has no disk, memory or configured room for is raised at once (:class:`ResourceError`:
a reconnect cannot fix it; a worker's statements wait as for a lost connection); a server that takes
no writes (a standby, a failover in progress, ``default_transaction_read_only``) is a
connection error (:class:`ServerUnavailable`), so Kombu reconnects and retries.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import psycopg
from psycopg import errors, pq

from . import _sql
from ._deadline import WATCHDOG
from ._options import DEFAULT_SCHEMA
from .exceptions import (
    MessageError,
    PrivilegeError,
    ResourceError,
    SchemaError,
    ServerUnavailable,
)

MIGRATE_COMMAND = "python -m kombu_pgqueue migrate --dsn <dsn> --schema {schema}"


def migrate_command(schema: str) -> str:
    """The command that installs or upgrades ``schema``: Celery's, where Celery runs
    (the app knows the DSN and the schema), and the module's, which works anywhere."""
    command = MIGRATE_COMMAND.format(schema=schema)
    if "celery" in sys.modules:
        return f"celery -A <your app> pgqueue migrate (or {command})"
    return command


@contextmanager
def translated(
    name: str,
    schema: str,
    forget_schema: Callable[[], None],
    role: str = "the database role",
    *,
    publish: bool = False,
) -> Iterator[None]:
    """Statement ``name`` on ``schema``: its errors as pgqueue's. ``forget_schema`` is
    called when a table is missing (the schema is checked again on the next connect).
    A ``publish`` that the server lacks the resources for fails at once; other
    statements (a worker's claims and acks) keep it a connection error, and wait."""
    try:
        yield
    except errors.ReadOnlySqlTransaction as exc:
        raise read_only(exc.pgconn, exc.diag.message_primary or str(exc)) from exc
    except errors.UndefinedTable as exc:
        forget_schema()
        raise SchemaError(
            f"pgqueue schema {schema!r} is missing a table ({exc.diag.message_primary}); "
            "run: python -m kombu_pgqueue migrate"
        ) from exc
    except errors.InsufficientPrivilege as exc:
        raise PrivilegeError(
            f"{role} may not run {name!r} on schema {schema!r}: "
            f"{exc.diag.message_primary}. The schema's owner grants what a worker or a "
            "publisher needs (docs/operations.md, the grants; a schema upgraded since "
            "then has tables those grants predate: grant them again)"
        ) from exc
    except (errors.ProgramLimitExceeded, psycopg.DataError) as exc:
        # psycopg raises DataError itself for a NUL in text, before sending
        detail = exc.diag.message_primary or str(exc)
        raise MessageError(f"{name} on schema {schema!r}: {detail}") from exc
    except psycopg.OperationalError as exc:
        # by SQLSTATE: psycopg's DiskFull and OutOfMemory do not derive from its
        # InsufficientResources; too_many_connections is a wait, as a lost connection is
        if not publish or not (exc.sqlstate or "").startswith("53") or exc.sqlstate == "53300":
            raise
        raise insufficient(exc, name, schema) from exc


#: what each SQLSTATE of class 53 means for the operator, and what to do
_RESOURCES = {
    "53100": "the disk is full (its tablespace, or pg_wal): free space on the server",
    "53200": "the server is out of memory",
    "53400": "a configured limit was reached (see the server's log)",
}


def insufficient(exc: psycopg.Error, name: str, schema: str) -> ResourceError:
    """A publish the server lacks disk, memory or a limit for (SQLSTATE class 53)."""
    sqlstate = exc.sqlstate or "53000"
    cause = _RESOURCES.get(sqlstate, "the server lacks a resource (see its log)")
    error = ResourceError(
        f"{name} on schema {schema!r} refused by the database: {cause} (SQLSTATE "
        f"{sqlstate}: {exc.diag.message_primary}); not retried, a reconnect cannot fix it"
    )
    error.sqlstate = sqlstate
    return error


def where(pgconn: pq.abc.PGconn | None) -> str:
    """host:port of the server of ``pgconn`` (or "the server")."""
    if pgconn is None or not pgconn.host:
        return "the server"
    host = pgconn.host.decode()
    return f"{host}:{pgconn.port.decode()}" if not host.startswith("/") else host


def not_answering(pgconn: pq.abc.PGconn | None, seconds: float, option: str) -> ServerUnavailable:
    """A server that did not answer within ``seconds`` (transport option ``option``),
    whose connection was closed: a connection error, which Kombu's policy retries."""
    return ServerUnavailable(
        f"the database at {where(pgconn)} did not answer within {seconds:g} s (transport "
        f"option {option}): the server hangs, the network dropped, or a commit waits for a "
        "synchronous standby; the connection was closed. A write may have committed on the "
        "server before that (Kombu's retry of a Celery task publish is not queued twice: "
        "see dedup_task_ids)"
    )


@contextmanager
def answering(
    conn: psycopg.Connection, seconds: float, option: str, said: float | None = None
) -> Iterator[None]:
    """``conn``'s statements, cut off by the watchdog after ``seconds`` (its connection
    closed): then :func:`not_answering`, naming transport option ``option`` and its
    value ``said`` (default ``seconds``)."""
    with WATCHDOG.armed(conn, seconds) as watch:
        try:
            yield
        except (psycopg.OperationalError, psycopg.InterfaceError) as exc:
            if not watch.fired:
                raise
            raise not_answering(conn.pgconn, seconds if said is None else said, option) from exc


def read_only(pgconn: pq.abc.PGconn | None, detail: str | None = None) -> ServerUnavailable:
    """A server in recovery or read-only, as a connection error (wait for a primary)."""
    return ServerUnavailable(
        f"the database at {where(pgconn)} is read-only{f' ({detail})' if detail else ''}: "
        "a standby, a failover in progress, or default_transaction_read_only is on; "
        "waiting for a primary"
    )


@contextmanager
def writable() -> Iterator[None]:
    """A statement outside :func:`translated` (LISTEN, a migration check) that a
    read-only server refuses: a connection error, not psycopg's InternalError."""
    try:
        yield
    except errors.ReadOnlySqlTransaction as exc:
        raise read_only(exc.pgconn, exc.diag.message_primary or str(exc)) from exc


@contextmanager
def creating_schema(conn: psycopg.Connection, schema: str) -> Iterator[None]:
    """Installing or upgrading ``schema``: a role that may not create it is told how."""
    try:
        yield
    except errors.InsufficientPrivilege as exc:
        role, command = _role(conn), migrate_command(schema)
        owner = _owner(conn, schema)
        if owner is not None:  # an upgrade: only the schema's owner may change it
            raise PrivilegeError(
                f"role {role!r} may not upgrade the pgqueue schema {schema!r} in database "
                f"{conn.info.dbname!r} ({exc.diag.message_primary}): it is owned by "
                f"{owner!r}. Have {owner!r} run: {command}"
            ) from exc
        raise PrivilegeError(
            f"role {role!r} may not create the pgqueue schema {schema!r} in database "
            f"{conn.info.dbname!r} ({exc.diag.message_primary}). Let it create schemas in "
            "that database ("
            + _sql.advice("grant_create", conn, database=conn.info.dbname, role=role)
            + f"), or create the schema owned by it, or have an owner run: {command}"
        ) from exc


@contextmanager
def installing(conn: psycopg.Connection, schema: str, migration: str) -> Iterator[None]:
    """Running ``migration`` in ``schema``: a name there that is not pgqueue's (the
    application's own ``message`` table) is named, with what to do."""
    try:
        yield
    except (errors.DuplicateTable, errors.DuplicateObject, errors.DuplicateFunction) as exc:
        raise SchemaError(
            f"cannot install pgqueue in schema {schema!r} of database {conn.info.dbname!r}: "
            f"{exc.diag.message_primary} (migration {migration}); the schema holds tables "
            "that are not pgqueue's, and pgqueue needs a schema of its own. Set the "
            "transport option 'schema' to one that nothing else uses (the default is "
            f"{DEFAULT_SCHEMA!r}), or move the application's tables out of {schema!r}"
        ) from exc


@contextmanager
def using_schema(conn: psycopg.Connection, schema: str) -> Iterator[None]:
    """Reading ``schema``: a role that may not use it is told what to grant."""
    try:
        yield
    except errors.InsufficientPrivilege as exc:
        role = _role(conn)
        raise PrivilegeError(
            f"role {role!r} may not use the pgqueue schema {schema!r} in database "
            f"{conn.info.dbname!r} ({exc.diag.message_primary}). Its owner can run: "
            + _sql.advice("grant_usage", conn, schema=schema, role=role)
        ) from exc


@contextmanager
def staging(conn: psycopg.Connection, schema: str) -> Iterator[None]:
    """Creating the COPY staging table: a role that may not create temporary tables is told."""
    try:
        yield
    except errors.InsufficientPrivilege as exc:
        role, database = _role(conn), conn.info.dbname
        raise PrivilegeError(
            f"role {role!r} may not create temporary tables in database {database!r} "
            f"({exc.diag.message_primary}); a bulk publish to schema {schema!r} stages its "
            "messages with an ETA, for a TTL queue or with a taken dedup key in one. Its "
            "owner can allow TEMPORARY on the database: "
            + _sql.advice("grant_temporary", conn, database=database, role=role)
        ) from exc


def _owner(conn: psycopg.Connection, schema: str) -> str | None:
    """The owner of ``schema``, None if it does not exist (or cannot be read now)."""
    try:
        row = conn.execute(_sql.queries(schema)["schema_owner"], {"schema": schema}).fetchone()
    except psycopg.Error:
        return None
    return str(row[0]) if row else None


def _role(conn: psycopg.Connection) -> str:
    return conn.info.parameter_status("session_authorization") or conn.info.user
