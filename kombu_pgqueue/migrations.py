"""Schema migrations: forward-only ``sql/migrations/NNNN_slug.sql`` files.

Applied versions are recorded in ``<schema>.schema_migration``. :func:`migrate`
holds a transaction-level advisory lock keyed on the schema name, so workers that
start together cannot apply the same migration twice.
"""

from __future__ import annotations

import zlib

import psycopg
from psycopg import sql

from . import _sql
from ._errors import creating_schema, installing, migrate_command, using_schema
from ._options import DEFAULT_SCHEMA, check_schema
from .exceptions import SchemaError


def latest_version() -> int:
    """Return the version this code needs."""
    return _sql.migration_files()[-1][0]


def _lock_key(schema: str) -> int:
    # a signed 64-bit key: stable across processes, distinct per schema
    return zlib.crc32(f"pgqueue:{schema}".encode()) - 2**31


def current_version(conn: psycopg.Connection, schema: str = DEFAULT_SCHEMA) -> int:
    """Return the schema's applied version, 0 when it has none."""
    schema = check_schema(schema)
    row = conn.execute(
        "SELECT to_regclass(format('%%I.schema_migration', %(schema)s::text)) IS NOT NULL",
        {"schema": schema},
    ).fetchone()
    if not row or not row[0]:
        return 0
    found = conn.execute(
        sql.SQL("SELECT coalesce(max(version), 0) FROM {}.schema_migration").format(
            sql.Identifier(schema)
        )
    ).fetchone()
    return int(found[0]) if found else 0


def migrate(
    conninfo: str | psycopg.Connection, schema: str = DEFAULT_SCHEMA, *, to: int | None = None
) -> list[int]:
    """Bring ``schema`` up to the latest version, or to version ``to`` (an upgrade that
    expands first and contracts later, one step at a time); return the versions
    applied."""
    schema = check_schema(schema)
    target = latest_version() if to is None else to
    if not 1 <= target <= latest_version():
        raise ValueError(f"to={to}: this code knows versions 1 to {latest_version()}")
    if isinstance(conninfo, psycopg.Connection):
        return _migrate(conninfo, schema, target)
    with psycopg.connect(conninfo) as conn:
        return _migrate(conn, schema, target)


def _schema_exists(conn: psycopg.Connection, schema: str) -> bool:
    row = conn.execute(
        "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_namespace WHERE nspname = %(schema)s)",
        {"schema": schema},
    ).fetchone()
    return bool(row and row[0])


def _migrate(conn: psycopg.Connection, schema: str, target: int) -> list[int]:
    applied: list[int] = []
    ident = sql.Identifier(schema)
    with creating_schema(conn, schema), conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (_lock_key(schema),))
        # IF NOT EXISTS is no help: PostgreSQL checks CREATE on the database (and on the
        # schema, for a table) before it looks, so a role that owns the schema, or may
        # only read its version, would be refused. Under the lock, looking first is safe.
        if not _schema_exists(conn, schema):
            conn.execute(sql.SQL("CREATE SCHEMA {}").format(ident))
        done = current_version(conn, schema)
        if done == 0:
            conn.execute(
                sql.SQL(
                    "CREATE TABLE IF NOT EXISTS {}.schema_migration ("
                    " version integer PRIMARY KEY,"
                    " name text NOT NULL,"
                    " applied_at timestamptz NOT NULL DEFAULT now())"
                ).format(ident)
            )
        for version, slug, text in _sql.migration_files():
            if version <= done or version > target:
                continue
            with installing(conn, schema, f"{version:04d}_{slug}"):
                conn.execute(_sql.compose(text, schema))
            conn.execute(
                sql.SQL("INSERT INTO {}.schema_migration (version, name) VALUES (%s, %s)").format(
                    ident
                ),
                (version, slug),
            )
            applied.append(version)
    return applied


def describe(have: int, migrate_command: str) -> str:
    """The installed version ``have`` against this code's, and what to do about it
    (``migrate_command`` names the command that upgrades)."""
    need = latest_version()
    if have > need:
        return f"version {have}, newer than this code ({need}): upgrade kombu-pgqueue"
    if have < need:
        state = "not installed" if have == 0 else f"version {have}"
        return f"{state}, code needs {need}: run {migrate_command}"
    return f"version {have}, current"


def check(conn: psycopg.Connection, schema: str = DEFAULT_SCHEMA) -> None:
    """Raise :class:`SchemaError` unless ``schema`` is at the latest version."""
    have, need = current_version(conn, schema), latest_version()
    if have >= need:
        return
    state = "is not installed" if have == 0 else f"is at version {have}"
    raise SchemaError(
        f"pgqueue schema {schema!r} in database {conn.info.dbname!r} {state}; this code "
        f"needs version {need}. Have a role that may create it (the schema's owner) run: "
        f"{migrate_command(schema)}; or, for a role that may, leave the "
        "transport option auto_migrate on"
    )


def ensure(conn: psycopg.Connection, schema: str, *, auto_migrate: bool) -> None:
    """Migrate ``schema`` when allowed, else check it; cheap when already current."""
    with using_schema(conn, schema):
        have = current_version(conn, schema)
    if have >= latest_version():
        return
    if auto_migrate:
        migrate(conn, schema)
    else:
        check(conn, schema)
