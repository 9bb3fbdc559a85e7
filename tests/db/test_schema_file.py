"""``kombu_pgqueue/sql/schema.sql`` is the schema a fresh ``migrate`` leaves.

The file is installed into one fresh schema and the migrations into another, on the
same server, and both are described from the catalog (``catalog.describe``: relations,
columns, constraints, indexes, triggers, functions, sequences, privileges, comments,
the rows installed), with the schema's name written ``{schema}``. A difference fails
with the lines that differ, as a diff from the file to the migrations.
"""

from __future__ import annotations

import difflib
import uuid
from collections.abc import Iterator
from importlib import resources

import catalog
import psycopg
import pytest
from psycopg import sql

from kombu_pgqueue import _sql, migrate
from kombu_pgqueue.migrations import latest_version

SCHEMA_FILE = "kombu_pgqueue/sql/schema.sql"


def schema_text() -> str:
    """schema.sql as the package ships it (read as the migrations are)."""
    return resources.files("kombu_pgqueue").joinpath("sql", "schema.sql").read_text("utf-8")


def install_schema_file(dsn: str, schema: str) -> None:
    """Create ``schema`` and apply schema.sql in it, in one transaction, as ``migrate``
    applies a migration."""
    with psycopg.connect(dsn) as conn, conn.transaction():
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
        conn.execute(_sql.compose(schema_text(), schema))


@pytest.fixture
def schemas(dsn: str) -> Iterator[tuple[str, str]]:
    """Two schema names, neither a part of the other: one for the file, one for
    ``migrate``; dropped afterwards."""
    token = uuid.uuid4().hex[:12]
    names = (f"t_file_{token}", f"t_migrated_{token}")
    yield names
    with psycopg.connect(dsn, autocommit=True) as conn:
        for name in names:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(name)))


def test_the_schema_file_and_a_fresh_migrate_agree(dsn: str, schemas: tuple[str, str]) -> None:
    from_file, migrated = schemas
    migrate(dsn, migrated)
    install_schema_file(dsn, from_file)

    with psycopg.connect(dsn, autocommit=True) as conn:
        # every name outside pg_catalog written with its schema, whatever the DSN's role sets
        conn.execute("SET search_path = pg_catalog")
        got, want = catalog.describe(conn, from_file), catalog.describe(conn, migrated)

    last = f"{latest_version():04d}"
    diff = list(
        difflib.unified_diff(got, want, SCHEMA_FILE, f"migrations 0001 to {last}", lineterm="", n=2)
    )
    if diff:
        pytest.fail(
            f"{SCHEMA_FILE} and a fresh migrate disagree ('-': only the file has it, '+': "
            f"only the migrations have it); change the file as migration {last} changed "
            "the schema:\n" + "\n".join(diff),
            pytrace=False,
        )


def test_the_schema_file_says_which_migrations_it_is() -> None:
    last = f"{latest_version():04d}"
    first_line = schema_text().splitlines()[0]
    assert f"migrations 0001 to {last} leave it" in first_line, (
        f"{SCHEMA_FILE} begins {first_line!r}: name the latest migration, {last}"
    )
