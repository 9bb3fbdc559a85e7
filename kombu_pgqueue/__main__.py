"""``python -m kombu_pgqueue migrate|version|sql``: schema management without Celery."""

from __future__ import annotations

import argparse
import os
import sys

import psycopg

from . import _sql, migrations
from ._options import DEFAULT_SCHEMA, mask
from .exceptions import PgQueueError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kombu_pgqueue")
    parser.add_argument(
        "--dsn",
        default=os.environ.get("PGQUEUE_DSN", ""),
        help="libpq connection string or URL (default: $PGQUEUE_DSN, then libpq's PG* variables)",
    )
    parser.add_argument("--schema", default=DEFAULT_SCHEMA, help="broker schema (default: pgqueue)")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("migrate", help="install or upgrade the broker schema")
    sub.add_parser("version", help="print the schema's version and the one this code needs")
    sub.add_parser("sql", help="print the migrations' SQL for the schema, to apply by hand")
    args = parser.parse_args(argv)

    if args.command == "sql":
        with psycopg.connect(args.dsn) as conn:
            for version, slug, text in _sql.migration_files():
                print(f"-- {version:04d}_{slug}")
                print(_sql.compose(text, args.schema).as_string(conn))
        return 0
    try:
        with psycopg.connect(args.dsn, autocommit=True) as conn:
            if args.command == "migrate":
                applied = migrations.migrate(conn, args.schema)
                done = ", ".join(map(str, applied)) or "nothing (already current)"
                print(f"schema {args.schema!r}: applied {done}")
            else:
                have = migrations.current_version(conn, args.schema)
                need = migrations.latest_version()
                print(f"schema {args.schema!r}: version {have}, code needs {need}")
    except psycopg.OperationalError as exc:
        print(
            f"cannot connect to {mask(args.dsn) or 'the default database'}: {exc}", file=sys.stderr
        )
        return 2
    except PgQueueError as exc:
        print(str(exc), file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
